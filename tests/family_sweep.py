"""The sweep of issue #28: every causal-LM and masked-LM (encoder) family the installed transformers offers,
built from its configuration class's defaults shrunk (hidden 64, 2 layers, 4 heads, vocabulary 128) on the
meta device (no weights, no download), through the automatic tp plan at tp=2 (its share sharded), context
parallelism's reachability check at cp=2 and the pipeline cut at pp=2. Pure: seconds per family.

``sweep()`` returns one row per family; ``tests/test_family_sweep.py`` checks its invariants (every family built
plans or is refused by lightning-4d with a fix; no other error) and that docs/zoo.md holds the table
``docs/zoo_table.py`` writes from it for the installed transformers, when the page has that version's section.
A verdict is ``refused: ...`` only for lightning-4d's own refusal (:func:`_verdict`); anything else is
``error: ...``, which the invariants fail.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import lightning_4d
from lightning_4d.context_parallel.reachability import check_attention_reachable
from lightning_4d.pipeline.config import PipelineConfig
from lightning_4d.pipeline.plan import PipelinePlan
from lightning_4d.tensor_parallel import plan_tensor_parallel
from lightning_4d.tensor_parallel.plan import SHARDED_STYLES, _under

SHRUNK = {  # every name a configuration class may use for these sizes
    ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim"): 64,
    ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "decoder_layers",
     "encoder_layers", "num_encoder_layers"): 2,
    ("num_attention_heads", "num_heads", "n_head", "n_heads", "decoder_attention_heads",
     "encoder_attention_heads"): 4,
    ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"): 2,
    ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim"): 256,
    ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"): 64,
    ("num_experts", "n_routed_experts", "num_local_experts"): 4,
    ("vocab_size",): 128,
    ("max_position_embeddings", "n_positions"): 64,
    ("head_dim", "d_kv", "kv_channels"): 16,
}
# Sizes a configuration may leave unset (None) for the model to read as given: set them too.
FILLED_WHEN_UNSET = ("head_dim", "n_routed_experts", "num_key_value_heads")
# Sizes a family ties to others beyond the names above, each as the family's configuration spells it.
FAMILY_SIZES: dict[str, dict] = {
    "funnel": {"block_sizes": [1, 1], "num_decoder_layers": 1},  # layers given per block, not in all
    "mobilebert": {"embedding_size": 64, "intra_bottleneck_size": 64, "true_hidden_size": 64},
    "squeezebert": {"embedding_size": 64},  # its first block takes the embedding at the hidden width
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh"], "axial_pos_shape": [8, 8],
                 "axial_pos_embds_dim": [32, 32]},  # causal LM only as a decoder; axial positions = 64
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0}, "ffn_config": {"ffn_hidden_size": 256, "moe_num_experts": 4}},
    "esm": {"vocab_size": 128, "pad_token_id": 1, "mask_token_id": 32},  # no vocabulary by default (proteins)
    "dots1": {"n_shared_experts": 1, "num_experts_per_tok": 2},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one global and one local layer
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,  # the last two read the first two's k/v
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8},  # hidden 64 x expand 2 = 8 heads of 16
    "zamba2": {"num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid"] * 2,  # the shared block twice
               "layer_types": ["mamba", "hybrid"] * 2},  # (5.24 reads the kinds from layer_types)
    "zamba": {"num_hidden_layers": 5, "attn_layer_period": 2, "attn_layer_offset": 1,  # the shared block twice
              "layer_types": ["mamba", "mamba", "hybrid", "mamba", "hybrid"]},  # (5.24 names the kinds so)
    "xlnet": {"mem_len": None},
    # transformers 5.24's families
    "esmc": {"num_key_value_heads": 4},  # no grouped queries
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},  # its own validation refuses its default
    "qwen4_exp": {"num_experts_per_tok": 2}, "qwen4_exp_text": {"num_experts_per_tok": 2},  # <= the 4 experts
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
}
# Families left out, and why (each is written into docs/zoo.md with its reason).
SKIPPED: dict[str, str] = {
    "gemma4_assistant": "transformers 5.24's default configuration fails its own validation (its text model's "
                        "hidden_size_per_layer_input, MoE block and double-wide MLP must be off; they are on)",
    "qwen4_exp": "transformers 5.24's default configuration leaves the attention indexer's token budget and "
                 "compression ratio unset (None), which its attention divides",
    "qwen4_exp_text": "as qwen4_exp",
    "gemma3n": "its causal-LM class is the multimodal Gemma3nForConditionalGeneration, whose vision tower needs "
               "the timm package; the text model is swept as gemma3n_text",
}


@dataclass(frozen=True)
class Row:
    family: str
    kind: str  # "causal" or "encoder"
    model: str  # the class built, or "" when it could not be built
    tp: str  # "NN%" or "refused: <first sentence>"
    cp: str  # "ok" or "refused: ..."
    pp: str
    blocks: str = ""  # the share sharded inside repeated blocks ("NN%"): the body's share without the
    # position tables and projections that a shrunk model weighs far above their weight at real sizes
    experts: bool = False  # a mixture-of-experts family: its experts are #30's (expert parallelism)
    strict: str = ""  # what tp_strict=True says of the plan ("refused: ..." below 90% of the body), else ""
    fixed: str = ""  # under a refused tp: the share the plan shards with the tp_plan its refusals name, or the
    # refusal left ("refused: ...")
    pp_fixed: str = ""  # under a pp refusal naming a pp_blocks: "ok" when the cut plans with it, else its refusal


def _families() -> list[tuple[str, str, str]]:
    from transformers.models.auto import modeling_auto as auto

    found = [(f, "causal", c) for f, c in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]
    found += [(f, "encoder", c) for f, c in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.items()
              if f not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    return sorted((f, k, c) for f, k, c in found if f not in SKIPPED)


def skipped() -> dict[str, str]:
    """The families of the installed transformers left out of the sweep, with the reason."""
    from transformers.models.auto import modeling_auto as auto

    offered = {*auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES}
    return {family: why for family, why in SKIPPED.items() if family in offered}


def _config(family: str, class_name: str):
    """The model class's own configuration, its defaults shrunk: sizes given to the constructor, so that what a
    configuration derives from them (layer types per layer, head sizes) agrees."""
    import inspect

    import transformers

    config_class = getattr(transformers, class_name).config_class
    accepted = inspect.signature(config_class.__init__).parameters
    try:
        default = config_class()
    except Exception:  # noqa: BLE001 - a default its own validation refuses (transformers 5.24's Gemma 4 assistant)
        default = config_class(**{n: v for n, v in FAMILY_SIZES.get(family, {}).items() if n in accepted})
    sizes = {}
    for names, value in SHRUNK.items():
        for name in names:
            try:
                current = getattr(default, name, "absent")
            except Exception:  # noqa: BLE001 - transformers 5.24's per-layer attributes refuse a global read
                current = "absent"
            if type(current) is int or (current is None and name in FILLED_WHEN_UNSET):
                sizes[name] = value
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if type(getattr(default, name, None)) is int and getattr(default, name) >= 128:  # noqa: B009
            sizes[name] = 0  # inside the shrunk vocabulary
    kinds = getattr(default, "layer_types", None)  # per-layer kinds: each kind once, in its first order
    if isinstance(kinds, list) and kinds:
        sizes["layer_types"] = (list(dict.fromkeys(kinds)) * 2)[:2]
    sizes.update(FAMILY_SIZES.get(family, {}))
    config = config_class(**{name: value for name, value in sizes.items() if name in accepted})
    for name, value in sizes.items():
        if name not in accepted and getattr(config, name, value) != value:
            try:
                setattr(config, name, value)
            except (AttributeError, NotImplementedError):  # derived (a property) or refused: the default stands
                pass
    return config


PACKAGE = Path(lightning_4d.__file__).resolve().parent
# A refusal's message says what to do: use/pass/set another value, a tp_plan or pp_blocks, or a size of 1.
NAMES_A_FIX = re.compile(r"\b([Uu]se|[Pp]ass|[Ss]et|[Gg]ive|[Mm]ake|[Aa]dd|[Nn]ame)\b|tp_plan|pp_blocks|=1\b")


def is_refusal(error: BaseException) -> bool:
    """lightning-4d refusing a model: a ValueError raised in lightning_4d's own code, whose message names a fix
    (not a library's exception passing through it, not a crash)."""
    frames = traceback.extract_tb(error.__traceback__)
    raised_here = bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE)
    return isinstance(error, ValueError) and raised_here and bool(NAMES_A_FIX.search(str(error)))


def _verdict(check) -> str:
    try:
        result = check()
    except Exception as error:  # noqa: BLE001 - the row records what each check says, refusal or failure
        first = str(error).strip().split("\n")[0]
        if not is_refusal(error):
            where = traceback.extract_tb(error.__traceback__)[-1]
            return f"error: {type(error).__name__}: {first[:700]} ({where.filename}:{where.lineno})"
        return f"refused: {type(error).__name__}: {first[:700]}"
    return result if isinstance(result, str) else "ok"


def sweep_family(family: str, kind: str, class_name: str) -> Row:
    import transformers

    model, error = None, None
    for attention in ("sdpa", "eager"):  # eager where a family offers no sdpa (cp's check then says so)
        try:
            config = _config(family, class_name)
            config._attn_implementation = attention
            with torch.device("meta"):
                model = getattr(transformers, class_name)(config)
            break
        except Exception as caught:  # noqa: BLE001
            error = caught
    if model is None:
        first = (str(error).splitlines() or [""])[0][:200]
        return Row(family, kind, "", f"not built: {type(error).__name__}: {first}", "", "")
    plans = []
    tp = _verdict(lambda: f"{plans.append(plan_tensor_parallel(model, 2)) or plans[0].coverage.share:.0%}")
    cp = _verdict(lambda: check_attention_reachable(model, 2))
    pp = _verdict(lambda: PipelinePlan.build(model, PipelineConfig(pp=2)) and None)
    strict = _verdict(lambda: plans[0].coverage.check(2, strict=True)) if plans else ""
    return Row(family, kind, class_name, tp, cp, pp, _block_share(model, plans[0]) if plans else "",
               _has_experts(model), "" if strict == "ok" else strict, "" if plans else _with_fixes(model),
               _with_pp_fix(model, pp))


def _with_pp_fix(model, pp: str) -> str:
    """Cuts again with the block list a pp refusal names (pp_blocks='...'), as tp's fixes are applied: "ok" when
    that plans, else its refusal; "" when the refusal names no pp_blocks (it names pp=1, or none is refused)."""
    import re

    named = re.search(r"pp_blocks(?:=|: )'?([\w.]+)", pp) if pp.startswith("refused") else None
    if named is None:
        return ""
    return _verdict(lambda: PipelinePlan.build(model, PipelineConfig(pp=2, blocks=named.group(1))) and None)


def _with_fixes(model, rounds: int = 8) -> str:
    """Plans again with the tp_plan each refusal names as its fix, merged, until one plans (its share) or a
    refusal names no tp_plan (that refusal)."""
    import ast

    fixes: dict[str, str] = {}
    for _ in range(rounds):
        try:
            return f"{plan_tensor_parallel(model, 2, fixes).coverage.share:.0%}"
        except Exception as error:  # noqa: BLE001 - a refusal naming a tp_plan is applied; any other is the verdict
            named = re.search(r"tp_plan: (\{[^{}]*\})", str(error)) if is_refusal(error) else None
            if named is None:
                return f"{'refused' if is_refusal(error) else 'error'}: {str(error).splitlines()[0][:700]}"
            fixes.update(ast.literal_eval(re.sub(r": (\w+)", r": '\1'", named.group(1))))
    return f"refused: still refused after {rounds} fixes: {fixes}"


def _block_share(model, plan) -> str:
    """The share of the parameters inside repeated blocks (a numbered FQN segment) that the plan shards."""
    sharded_modules = [fqn for fqn, style in plan.styles.items() if style.style in SHARDED_STYLES]
    sharded = total = 0
    for fqn, module in model.named_modules():
        if any(part.isdigit() for part in fqn.split(".")):
            count = sum(p.numel() for p in module.parameters(recurse=False))
            total += count
            sharded += count if _under(fqn, sharded_modules) else 0
    return f"{sharded / total:.0%}" if total else ""


def _has_experts(model) -> bool:
    return any(fqn.rpartition(".")[2] == "experts" or "moe" in type(module).__name__.lower()
               for fqn, module in model.named_modules())


def sweep() -> list[Row]:
    return [sweep_family(*family) for family in _families()]


if __name__ == "__main__":
    import time

    for family in _families():
        start = time.time()
        row = sweep_family(*family)
        print(f"{time.time() - start:5.2f}s", row)
