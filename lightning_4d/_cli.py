"""What the command lines (``python -m lightning_4d.plan``, ``python -m lightning_4d.export``) share: one way to
name a class (``--module package.module:Class``) and one way to fail (exit status 2 and one line on stderr,
``prog: error: message``, as argparse reports a bad argument). Imports nothing heavy, so ``--help`` is quick."""

from __future__ import annotations

import argparse
import importlib
from typing import NoReturn

CLASS_SYNTAX = "package.module:Class"


class CommandLineError(Exception):
    """A known failure of a command: reported as one line, exit status 2."""


def fail(parser: argparse.ArgumentParser, message: object) -> NoReturn:
    """Exit 2 with ``prog: error: message`` (one line), like argparse's own errors."""
    text = " ".join(str(message).split())
    parser.exit(2, f"{parser.prog}: error: {text}\n")


def import_class(spec: str, option: str = "--module") -> type:
    """The class named ``package.module:Class`` (``package.module.Class`` is accepted too)."""
    module_name, _, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not name:
        raise CommandLineError(f"{option} {spec!r}: write {CLASS_SYNTAX}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise CommandLineError(f"{option} {spec!r}: cannot import {module_name!r} ({error}).") from None
    value = getattr(module, name, None)
    if not isinstance(value, type):
        raise CommandLineError(f"{option} {spec!r}: {module_name!r} has no class {name!r}.")
    return value
