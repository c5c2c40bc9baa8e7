"""specserve sets its OpenMP defaults only in processes it owns (the command line), never on import as a
library, and never over a value the user chose."""
import json
import os
import subprocess
import sys

from specserve.process_env import OMP_DEFAULTS

SHOW = "import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))" % sorted(OMP_DEFAULTS)


def _run(imports: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in OMP_DEFAULTS}
    out = subprocess.run([sys.executable, "-c", f"{imports}; {SHOW}"], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_importing_the_library_leaves_the_environment_alone():
    assert _run("import specserve, specserve.llm, specserve.engine.engine") == dict.fromkeys(OMP_DEFAULTS)


def test_the_command_line_sets_its_defaults_where_the_user_has_not():
    assert _run("import specserve.cli") == OMP_DEFAULTS
    assert _run("import specserve.cli", OMP_WAIT_POLICY="ACTIVE") == {**OMP_DEFAULTS, "OMP_WAIT_POLICY": "ACTIVE"}
