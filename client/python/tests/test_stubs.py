"""The shipped gRPC stubs are what scripts/gen_python_stubs.sh makes from proto/ today."""

import subprocess
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "client" / "python" / "shardcast" / "v1"


def test_shipped_stubs_match_the_protos(tmp_path: Path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_python_stubs.sh"), str(tmp_path)], check=True)
    generated = sorted(p.name for p in (tmp_path / "shardcast" / "v1").glob("*_pb2*.py"))
    shipped = sorted(p.name for p in PACKAGE.glob("*_pb2*.py"))
    assert generated == shipped
    stale = [name for name in generated
             if (tmp_path / "shardcast" / "v1" / name).read_bytes() != (PACKAGE / name).read_bytes()]
    assert not stale, f"stubs out of date: {stale}; run scripts/gen_python_stubs.sh and commit"
