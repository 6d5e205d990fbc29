"""Every file read from an adapter directory, the chat template's included: confined to
--allowed-local-dirs, regular and size-bounded, read once at load time, covered by the digest."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from loraplex.services.inference.errors import AdapterInvalid, InvalidRequest
from loraplex.services.inference.local_sources import check_allowed
from loraplex.services.inference.lora.adapter_files import MAX_TEMPLATE_FILE_BYTES
from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.manager import LoRAManager
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
SECRET = "the secret outside the allowed directory\n"


@pytest.fixture(scope="module")
def shapes(tiny_llama_path) -> ModelShapes:
    return ModelShapes.from_model_dir(tiny_llama_path)


@pytest.fixture(scope="module")
def good(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "files-good", r=4, target_modules=["q_proj", "v_proj"])


@pytest.fixture
def dirs(tmp_path, good) -> tuple[Path, Path]:
    """(an adapter inside the allowed directory, a secret file outside it)."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    shutil.copytree(good, allowed / "adapter")
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    return allowed / "adapter", outside / "secret.txt"


def manager(shapes) -> LoRAManager:
    import torch

    pool = AdapterPool(
        shapes, slots=2, max_rank=8, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    return LoRAManager(pool)


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json"])
def test_template_file_symlinked_out_of_the_allowed_dirs_is_refused(dirs, name):
    adapter, secret = dirs
    (adapter / name).symlink_to(secret)
    with pytest.raises(InvalidRequest) as err:
        check_allowed(str(adapter), (str(adapter.parent),))
    assert name in err.value.message and "--allowed-local-dirs" in err.value.message
    assert SECRET.strip() not in err.value.message
    # A symlink that stays inside (how a Hub cache snapshot is laid out) is fine.
    (adapter / name).unlink()
    (adapter.parent / "blob").write_text(json.dumps({"chat_template": TEMPLATE}))
    (adapter / name).symlink_to(adapter.parent / "blob")
    assert check_allowed(str(adapter), (str(adapter.parent),)) == adapter


def test_template_is_read_at_load_time_and_kept(dirs, shapes):
    adapter, _ = dirs
    (adapter / "chat_template.jinja").write_text(TEMPLATE)
    m = manager(shapes)
    m.load_adapter("t", adapter)
    assert m.chat_template("t") == TEMPLATE
    # Whoever can write the directory later cannot change what the loaded version renders.
    (adapter / "chat_template.jinja").write_text("{{ raise_exception('changed') }}")
    assert m.chat_template("t") == TEMPLATE
    (adapter / "chat_template.jinja").unlink()
    assert m.chat_template("t") == TEMPLATE


def test_template_is_part_of_the_content_digest(dirs, shapes):
    adapter, _ = dirs
    plain = load_adapter_weights(adapter, shapes)
    assert plain.chat_template is None
    (adapter / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    from_config = load_adapter_weights(adapter, shapes)
    assert from_config.chat_template == TEMPLATE and from_config.digest != plain.digest
    (adapter / "chat_template.jinja").write_text(TEMPLATE)  # the .jinja file wins
    jinja = load_adapter_weights(adapter, shapes)
    assert jinja.chat_template == TEMPLATE and jinja.digest not in (plain.digest, from_config.digest)
    (adapter / "chat_template.jinja").write_text(TEMPLATE + " ")
    assert load_adapter_weights(adapter, shapes).digest != jinja.digest
    # A reload of the same name with another template is another version.
    m = manager(shapes)
    first = m.load_adapter("t", adapter)
    (adapter / "chat_template.jinja").write_text(TEMPLATE)
    second = m.load_adapter("t", adapter)
    assert first.digest != second.digest and m.chat_template("t") == TEMPLATE


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
        (lambda p: p.mkdir(), "not a regular file"),
        (lambda p: p.symlink_to(p.parent / "nowhere"), "dangling symlink"),
        (
            lambda p: p.write_bytes(b"x" * (MAX_TEMPLATE_FILE_BYTES + 1)),
            f"over {MAX_TEMPLATE_FILE_BYTES} bytes",
        ),
        (lambda p: p.write_bytes(b"{{ \xff\xfe }}"), "not UTF-8"),
    ],
)
def test_unusable_template_files_are_refused_at_once(dirs, shapes, make, why):
    adapter, _ = dirs
    make(adapter / "chat_template.jinja")
    start = time.monotonic()
    with pytest.raises(AdapterInvalid) as err:
        load_adapter_weights(adapter, shapes)
    assert time.monotonic() - start < 10
    assert why in err.value.message and err.value.field == "chat_template.jinja"


@pytest.mark.parametrize("text", ["not json", "[1, 2]", "[" * 100_000])
def test_unreadable_tokenizer_config_is_refused(dirs, shapes, text):
    adapter, _ = dirs
    (adapter / "tokenizer_config.json").write_text(text)
    with pytest.raises(AdapterInvalid) as err:
        load_adapter_weights(adapter, shapes)
    assert err.value.field == "tokenizer_config.json"
