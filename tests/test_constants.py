"""The numbers Python passes to the ops are the ones the C API defines.

csrc/posenc.h holds one enum per set of constants (float dtypes, pairings, models, position
rules, time rules); the Python package keeps its own copies of those numbers (it passes
plain ints through the op schemas).  These tests parse the enums out of posenc.h and compare
them with the Python tables, so a renumbering on either side fails here, not as a silently
wrong rule or model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from posenc_torch import _checks, _tables

POSENC_H = Path(__file__).resolve().parent.parent / "csrc" / "posenc.h"


def _enums(text: str) -> dict[str, dict[str, int]]:
    """``typedef enum name { A = 0, B, ... } name;`` -> {name: {A: 0, B: 1, ...}}."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out: dict[str, dict[str, int]] = {}
    for name, body in re.findall(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}", text, flags=re.S):
        values: dict[str, int] = {}
        nxt = 0
        for item in filter(None, (part.strip() for part in body.split(","))):
            key, _, value = (s.strip() for s in item.partition("="))
            nxt = int(value, 0) if value else nxt
            values[key] = nxt
            nxt += 1
        out[name] = values
    return out


@pytest.fixture(scope="module")
def enums() -> dict[str, dict[str, int]]:
    if not POSENC_H.exists():
        pytest.skip(f"needs the source tree (csrc/posenc.h next to tests/), not found at "
                    f"{POSENC_H}")
    return _enums(POSENC_H.read_text())


def test_parser_reads_explicit_and_implicit_values():
    got = _enums("typedef enum e { A = 2, /* two */ B, C = -1, D } e;")
    assert got == {"e": {"A": 2, "B": 3, "C": -1, "D": 0}}


def test_float_dtypes_are_the_c_dtypes(enums):
    c_names = set(enums["pe_dtype"])
    py_names = {"PE_" + str(dt).removeprefix("torch.").upper() for dt in _checks.FLOAT_DTYPES}
    assert py_names == c_names
    # same order as the enum, so the Python list reads as the C table
    order = [enums["pe_dtype"]["PE_" + str(dt).removeprefix("torch.").upper()]
             for dt in _checks.FLOAT_DTYPES]
    assert order == list(range(len(order)))
    assert all(isinstance(dt, torch.dtype) for dt in _checks.FLOAT_DTYPES)


def test_pairing_codes(enums):
    pairing = enums["pe_pairing"]
    assert _checks.pairing_code("half") == pairing["PE_PAIR_HALF"]
    assert _checks.pairing_code("adjacent") == pairing["PE_PAIR_ADJACENT"]
    assert len(pairing) == 2


def test_model_ids(enums):
    models = enums["pe_mrope_model"]
    aliases = {"qwen3_vl_moe": "qwen3_vl"}  # the MoE text model shares Qwen3-VL's rules
    for name, entry in _tables.MROPE_MODELS.items():
        assert entry.mrope == models["PE_MROPE_" + aliases.get(name, name).upper()], name
    assert {m.mrope for m in _tables.MROPE_MODELS.values()} == set(models.values())
    for name, code in models.items():
        assert getattr(_tables, name.removeprefix("PE_")) == code, name


def test_rule_numbers(enums):
    rules = enums["pe_mrope_rules"]
    assert {"PE_MROPE_" + n: v for n, v in vars(_tables).items() if n.startswith("RULES_")} == rules
    # each convention maps to the rule set of its major release
    for name, convention in _tables.CONVENTIONS.items():
        want = "PE_MROPE_RULES_4_57" if name.startswith("4.") else "PE_MROPE_RULES_5"
        assert convention.rules == rules[want], name


def test_time_rule_numbers(enums):
    times = enums["pe_mrope_time"]
    python = {name: value for name, value in vars(_tables).items()
              if name.startswith("TIME_") and isinstance(value, int)}
    assert {"PE_" + n: v for n, v in python.items()} == times


def test_vision_interpolation_codes(enums):
    from posenc_torch import vision

    modes, paddings, rules = (enums[n] for n in ("pe_interp_mode", "pe_interp_padding",
                                                 "pe_interp_rule"))
    assert {"PE_INTERP_" + k.upper(): v for k, v in vision.INTERP_MODES.items()} == modes
    assert {"PE_INTERP_" + k.upper(): v for k, v in vision.INTERP_PADDINGS.items()} == paddings
    python = {name: value for name, value in vars(vision).items()
              if name.startswith("INTERP_") and isinstance(value, int)}
    assert {"PE_" + n: v for n, v in python.items()} == rules
