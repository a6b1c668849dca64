"""What ``pip install .`` (the Dockerfile's install) delivers: the wheel holds the tiny model's corpus and the
LICENSE, and its ``ferry-tiny-model`` works outside the checkout; the tiny model it makes can chat; the checkout's
.gitignore matches no tracked file."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from worker import tiny_model
from worker.tiny_model import CHAT_TEMPLATE, ensure_tiny_model

pytestmark = pytest.mark.integration  # builds and installs the wheel, runs its scripts

REPO = Path(__file__).resolve().parents[1]
# sha256 of each license's canonical text (Apache-2.0: apache.org's LICENSE-2.0.txt), by its SPDX id.
LICENSE_TEXTS = {"Apache-2.0": "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"}


def test_the_wheel_ships_the_corpus_and_makes_the_tiny_model_outside_the_checkout(tmp_path: Path) -> None:
    """Built from a clean copy of the source (no build/ or egg-info left over to fill the wheel), installed
    apart from the checkout, and run from elsewhere: the wheel's own modules and data make the model."""
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "bench", "tests", "docs", "models"))
    wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--quiet", "-w", str(wheels), str(source)], check=True, timeout=120)
    (wheel,) = wheels.glob("ferry_llm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "worker/data/corpus.txt" in names
    modules = {path.relative_to(source).as_posix() for package in ("api", "common", "worker", "server")
               for path in (source / package).rglob("*.py")}
    assert modules - set(names) == set()  # every module ships, subpackages' too (pyproject's packages names each)
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    subprocess.run([*pip, "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)], check=True, timeout=60)

    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    imported = subprocess.run([sys.executable, "-c", "import worker.tiny_model as m; print(m.__file__)"], cwd=elsewhere,
                              env=env, capture_output=True, text=True, check=True, timeout=60)
    assert Path(imported.stdout.strip()).is_relative_to(site)
    made = subprocess.run([str(site / "bin" / "ferry-tiny-model"), "tiny"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    model = elsewhere / "tiny"
    assert made.stdout.strip() == "tiny" and (model / "model.safetensors").is_file()
    assert (model / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_a_missing_corpus_is_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "data" / "corpus.txt"
    monkeypatch.setattr(tiny_model, "CORPUS", missing)
    with pytest.raises(SystemExit) as caught:
        tiny_model.main([str(tmp_path / "tiny")])
    assert caught.value.code == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(missing) in error and "os error" not in error
    assert not (tmp_path / "tiny").exists()


def test_the_tiny_model_has_a_chat_template(tiny_model_path: Path) -> None:
    """ChatML-like, after BOS: the README's chat examples work on the tiny model as it is made."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered == "<s><|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_a_tiny_model_made_before_the_chat_template_is_made_again(tmp_path: Path, tiny_model_path: Path) -> None:
    older = tmp_path / "tiny-llama"
    shutil.copytree(tiny_model_path, older, ignore=shutil.ignore_patterns("chat_template.jinja"))
    ensure_tiny_model(older)
    assert (older / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert (older / "model.safetensors").read_bytes() == (tiny_model_path / "model.safetensors").read_bytes()


def test_the_license_file_is_the_license_pyproject_names() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]
    license_id = declared if isinstance(declared, str) else declared["text"]  # PEP 639's string, or the table
    assert hashlib.sha256((REPO / "LICENSE").read_bytes()).hexdigest() == LICENSE_TEXTS[license_id]


def test_gitignore_ignores_no_tracked_file() -> None:
    """A tracked file that .gitignore matches is one side wrong: either it should not be committed (a build
    output, a model) or the pattern hides a new file beside it from ``git add``."""
    tracked_ignored = subprocess.run(["git", "ls-files", "--cached", "--ignored", "--exclude-standard"], cwd=REPO,
                                     capture_output=True, text=True, check=True, timeout=60)
    assert tracked_ignored.stdout == ""
