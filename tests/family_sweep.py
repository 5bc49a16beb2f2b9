"""The sweep of issue #28: every causal-LM and masked-LM (encoder) family the installed transformers offers,
built from its configuration class's defaults shrunk (hidden 64, 2 layers, 4 heads, vocabulary 128) on the
meta device (no weights, no download), through the automatic tp plan at tp=2 (its share sharded), context
parallelism's reachability check at cp=2 and the pipeline cut at pp=2. Pure: seconds per family.

``sweep()`` returns one row per family; ``tests/test_family_sweep.py`` checks it. (Not yet written into
docs/zoo.md; families whose defaults do not build once shrunk show as "not built" with the error.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_4d.context_parallel.reachability import check_attention_reachable
from lightning_4d.pipeline.config import PipelineConfig
from lightning_4d.pipeline.plan import PipelinePlan
from lightning_4d.tensor_parallel import plan_tensor_parallel

SHRUNK = {  # every name a configuration class may use for these sizes
    ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim"): 64,
    ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "decoder_layers",
     "encoder_layers"): 2,
    ("num_attention_heads", "num_heads", "n_head", "n_heads", "decoder_attention_heads",
     "encoder_attention_heads"): 4,
    ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"): 2,
    ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim"): 256,
    ("vocab_size",): 128,
    ("max_position_embeddings", "n_positions"): 64,
    ("head_dim", "d_kv", "kv_channels"): 16,
}
# Families left out, and why.
SKIPPED: dict[str, str] = {}


@dataclass(frozen=True)
class Row:
    family: str
    kind: str  # "causal" or "encoder"
    model: str  # the class built, or "" when it could not be built
    tp: str  # "NN%" or "refused: <first sentence>"
    cp: str  # "ok" or "refused: ..."
    pp: str


def _families() -> list[tuple[str, str, str]]:
    from transformers.models.auto import modeling_auto as auto

    found = [(f, "causal", c) for f, c in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]
    found += [(f, "encoder", c) for f, c in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.items()
              if f not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    return sorted((f, k, c) for f, k, c in found if f not in SKIPPED)


def _config(family: str):
    import transformers

    config = transformers.AutoConfig.for_model(family)
    for names, value in SHRUNK.items():
        for name in names:
            if type(getattr(config, name, None)) is int:
                setattr(config, name, value)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if type(getattr(config, name, None)) is int and getattr(config, name) >= 128:
            setattr(config, name, 0)  # inside the shrunk vocabulary
    return config


def _verdict(check) -> str:
    try:
        result = check()
    except Exception as error:  # noqa: BLE001 - the row records what each check says, refusal or failure
        first = str(error).strip().split("\n")[0]
        return f"refused: {type(error).__name__}: {first[:300]}"
    return result if isinstance(result, str) else "ok"


def sweep_family(family: str, kind: str, class_name: str) -> Row:
    import transformers

    model, error = None, None
    for attention in ("sdpa", "eager"):  # eager where a family offers no sdpa (cp's check then says so)
        try:
            config = _config(family)
            config._attn_implementation = attention
            with torch.device("meta"):
                model = getattr(transformers, class_name)(config)
            break
        except Exception as caught:  # noqa: BLE001
            error = caught
    if model is None:
        first = (str(error).splitlines() or [""])[0][:200]
        return Row(family, kind, "", f"not built: {type(error).__name__}: {first}", "", "")
    tp = _verdict(lambda: f"{plan_tensor_parallel(model, 2).coverage.share:.0%}")
    cp = _verdict(lambda: check_attention_reachable(model, 2))
    pp = _verdict(lambda: PipelinePlan.build(model, PipelineConfig(pp=2)) and None)
    return Row(family, kind, class_name, tp, cp, pp)


def sweep() -> list[Row]:
    return [sweep_family(*family) for family in _families()]


if __name__ == "__main__":
    import time

    for family in _families():
        start = time.time()
        row = sweep_family(*family)
        print(f"{time.time() - start:5.2f}s", row)
