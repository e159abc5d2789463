"""Shared fixtures of kvlm's Python tests: where the models, the kvlm binary
and the repository are (tests/cli_python.sh sets them; defaults for a clone)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
MODELS = Path(os.environ.get("KVLM_MODELS") or os.environ.get("KVLM_MODELS_DEFAULT") or ROOT.parent / "shared" / "models")
KVLM_BIN = os.environ.get("KVLM_BIN") or str(ROOT / "build" / "kvlm")
QUICK = os.environ.get("KVLM_TEST_QUICK") == "1"


def model(name: str) -> str:
    p = MODELS / name
    if not p.exists():
        pytest.skip(f"{p} not found (set KVLM_MODELS)")
    return str(p)


@pytest.fixture(scope="session")
def m260k() -> str:
    return model("stories260K.gguf")


@pytest.fixture(scope="session")
def m4m() -> str:
    return model("stories4M_hd64.gguf")
