"""A local source is read the same way by the store and the inference server: a file:// URI is
percent-decoded before any check, and what it decodes to is checked, not the raw text. A decoded NUL
is the caller's mistake (INVALID_ARGUMENT), not a ValueError from the OS call that became INTERNAL
(the inference fuzz test drew `file:///%00` and got "internal error: embedded null byte")."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.sources import parse_source
from loraplex.services.inference.errors import InvalidRequest
from loraplex.services.inference.local_sources import local_path, public_model_name


@pytest.mark.parametrize("source", ["file:///%00", "file:///tmp/a%00b", "file://localhost/%00/x"])
def test_a_decoded_nul_is_refused_by_both_services(source, tmp_path):
    with pytest.raises(InvalidArgument, match="NUL byte"):
        parse_source(source, "")
    for allowed in ((), (str(tmp_path),)):
        with pytest.raises(InvalidRequest, match="NUL byte"):
            local_path(source, allowed)


def test_decoding_happens_before_the_checks(tmp_path):
    (tmp_path / "inner").mkdir()
    (tmp_path / "adapter").mkdir()
    dotted = f"file://{tmp_path}/inner/%2E%2E/adapter"  # '..' once decoded: resolves beside inner
    assert local_path(dotted, (str(tmp_path),)) == tmp_path / "adapter"
    assert parse_source(dotted, "").location == str(tmp_path / "adapter")
    with pytest.raises(InvalidRequest, match="outside --allowed-local-dirs"):
        local_path(f"file://{tmp_path}/inner/%2E%2E/%2E%2E", (str(tmp_path / "inner"),))


def test_a_remote_host_is_refused_by_both_services():
    with pytest.raises(InvalidArgument, match="remote host"):
        parse_source("file://remote/x", "")
    with pytest.raises(InvalidRequest, match="remote host"):
        local_path("file://remote/x", ())


def test_the_public_model_name_is_the_decoded_last_part():
    assert public_model_name("file:///models/My%20Model/") == "My Model"
    assert public_model_name(str(Path("/models/tiny"))) == "tiny"
    assert public_model_name("org/repo") == "org/repo"
