"""The repository as a fresh clone gets it: nothing in it points at a path of the machine it was written on."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Absolute paths of a development machine: this workplace's mounts, home folders (Linux, macOS, Windows). Built
# from parts so that this file does not hold one itself.
_ROOTS = ["work", "root", r"home/[a-z][a-z0-9_]*", r"Users/\w+"]
MACHINE_PATH = re.compile(r"(^|[^A-Za-z0-9_.])/(" + "|".join(_ROOTS) + r")/|\b[A-Z]:\\Users\\")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / name for name in names.decode().split("\0") if name]
    return [p for p in paths if p.is_file() and p.suffix not in {".png", ".safetensors", ".gguf"}]


def test_no_absolute_path_of_a_machine_is_in_the_tree():
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "absolute paths of a machine:\n" + "\n".join(found)
