"""absl flags generated from ServerArgs: one flag per field, with the field's name, default
and help (runtime/server_args.py), so a new option is one field and no flag code."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from absl import flags

from runtime.server_args import ServerArgs

# The flags belong to the module that calls define_flags (its --help lists them).
flags.disclaim_key_flags()

# SGLang's spellings that name a field under another name (--model_path is SGLang's
# --model-path, the form its users type).
ALIASES = {"model_path": "model"}


def _flag_type(hint: Any) -> Any:
    """The field's type without its `| None`."""
    if isinstance(hint, types.UnionType):
        rest = [t for t in typing.get_args(hint) if t is not type(None)]
        assert len(rest) == 1, hint
        return rest[0]
    return hint


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Define --<field> for every ServerArgs field (ints, floats, strings, bools, enums
    where the field lists choices, comma-separated lists for the bucket tuples)."""
    hints = typing.get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        kind, helptext = _flag_type(hints[f.name]), f.metadata["help"]
        kw: dict[str, Any] = dict(flag_values=flag_values)
        if f.metadata["choices"]:
            flags.DEFINE_enum(f.name, f.default, list(f.metadata["choices"]), helptext, **kw)
        elif kind is bool:
            flags.DEFINE_bool(f.name, f.default, helptext, **kw)
        elif kind is int:
            flags.DEFINE_integer(f.name, f.default, helptext, **kw)
        elif kind is float:
            flags.DEFINE_float(f.name, f.default, helptext, **kw)
        elif kind is str:
            flags.DEFINE_string(f.name, f.default, helptext, **kw)
        elif typing.get_origin(kind) is tuple:
            default = None if f.default is None else [str(v) for v in f.default]
            flags.DEFINE_list(f.name, default, helptext, **kw)
        else:
            raise TypeError(f"ServerArgs.{f.name}: no flag for type {kind}")
    for alias, name in ALIASES.items():
        flags.DEFINE_alias(alias, name, flag_values=flag_values)


def args_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> ServerArgs:
    """ServerArgs from parsed flags: '' is None for optional strings ('--trace_dir='), an
    empty list None for the buckets, and a field's own `parse` last. Raises ValueError
    (validate()'s, naming the flags) for an invalid combination."""
    hints = typing.get_type_hints(ServerArgs)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ServerArgs):
        value, kind = flag_values[f.name].value, _flag_type(hints[f.name])
        optional = isinstance(hints[f.name], types.UnionType)
        if typing.get_origin(kind) is tuple:
            try:
                value = tuple(int(v) for v in value) if value else None
            except ValueError:
                raise ValueError(f"--{f.name}={','.join(value)}: expected comma-separated "
                                 "integers") from None
        elif optional and value == "":
            value = None
        if f.metadata["parse"] is not None:
            value = f.metadata["parse"](value)
        values[f.name] = value
    return ServerArgs(**values)
