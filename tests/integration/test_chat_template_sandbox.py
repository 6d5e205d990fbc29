"""Adapter chat templates in killable worker processes: a slow or huge template fails with a clear
INVALID_ARGUMENT naming it, other requests keep being served meanwhile, and SIGTERM still exits."""

from __future__ import annotations

import shutil
import signal
import threading
import time

import grpc
import pytest
from transformers import AutoTokenizer

from loraplex.clients.processes import ServerProcess
from loraplex.services.inference.engine.template_sandbox import TemplateRenderer
from loraplex.services.inference.errors import BackendUnavailable, CapacityExceeded, InvalidRequest
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import STARTUP_S

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
OWN = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
SLOW = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done"
HUGE = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def renderer():
    r = TemplateRenderer(workers=2, timeout_s=1.5)
    yield r
    r.close()


def render(renderer, tokenizer, template, max_chars=1 << 20):
    return renderer.render(
        template, MESSAGES, True, dict(tokenizer.special_tokens_map), max_chars, "template X"
    )


def test_renders_as_transformers_does(renderer, tokenizer):
    want = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, chat_template=OWN
    )
    assert render(renderer, tokenizer, OWN) == want


def test_slow_template_is_stopped_and_others_keep_rendering(renderer, tokenizer):
    render(renderer, tokenizer, OWN)  # a worker is up: the budget below is the render's alone
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            render(renderer, tokenizer, SLOW)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=slow)
    start = time.monotonic()
    thread.start()
    time.sleep(0.3)
    assert render(renderer, tokenizer, OWN).endswith("A:")  # served while the slow one runs
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - start < 1.5 + 10
    (error,) = errors
    assert isinstance(error, InvalidRequest) and "template X" in error.message and "budget" in error.message
    assert render(renderer, tokenizer, OWN).endswith("A:")  # its killed worker was replaced


@pytest.mark.parametrize("template, max_chars", [(HUGE, 1 << 20), ("{{ 'y' * 5000 }}", 4096)])
def test_huge_output_is_refused(renderer, tokenizer, template, max_chars):
    start = time.monotonic()
    with pytest.raises(InvalidRequest) as err:
        render(renderer, tokenizer, template, max_chars)
    assert "template X" in err.value.message and time.monotonic() - start < 1.5 + 10


def test_template_errors_are_the_requests(renderer, tokenizer):
    with pytest.raises(InvalidRequest) as err:
        render(renderer, tokenizer, "{{ raise_exception('no system role here') }}")
    assert "no system role here" in err.value.message


def test_close_abandons_a_render_under_way(tokenizer):
    r = TemplateRenderer(workers=1, timeout_s=60)
    render(r, tokenizer, OWN)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: errors.append(_catch(lambda: render(r, tokenizer, SLOW))))
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    r.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert isinstance(errors[0], BackendUnavailable)


def test_busy_workers_refuse_at_once_rather_than_hold_the_callers_thread(tokenizer):
    r = TemplateRenderer(workers=1, timeout_s=3)
    try:
        render(r, tokenizer, OWN)
        thread = threading.Thread(target=lambda: _catch(lambda: render(r, tokenizer, SLOW)))
        thread.start()
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(CapacityExceeded) as err:
            render(r, tokenizer, OWN)
        assert "busy" in err.value.message and time.monotonic() - start < 2.5
        thread.join(20)
        assert render(r, tokenizer, OWN).endswith("A:")
    finally:
        r.close()


def _catch(call) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_server_serves_others_during_a_slow_template_and_exits_on_sigterm(
    tmp_path, tiny_llama_path, adapter_factory
):
    good = adapter_factory(tiny_llama_path, "template-good", r=4, target_modules=["q_proj", "v_proj"])
    slow = tmp_path / "slow"
    shutil.copytree(good, slow)
    (slow / "chat_template.jinja").write_text(SLOW)
    proc = ServerProcess(
        "inference",
        "loraplex.services.inference",
        [
            "--model-path",
            str(tiny_llama_path),
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-total-tokens",
            "1024",
        ],
        echo=False,
    )
    try:
        proc.wait_serving(STARTUP_S)
        with grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            stub.LoadAdapter(pb.LoadAdapterRequest(name="slow", source=str(slow)), timeout=60)
            chat = pb.GenerateRequest(
                inputs=[pb.Input(messages=[pb.ChatMessage(role="user", content="hi")], adapter="slow")],
                sampling_params=pb.SamplingParams(max_new_tokens=2),
            )
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(chat, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "adapter 'slow'" in err.value.details() and "budget" in err.value.details()
            # Again, and meanwhile the base model answers at once; then SIGTERM while it renders.
            pending = stub.Generate.future(chat, timeout=60)
            time.sleep(0.5)
            start = time.monotonic()
            base = stub.Generate(
                pb.GenerateRequest(text=["hello"], sampling_params=pb.SamplingParams(max_new_tokens=2)),
                timeout=10,
            )
            assert base.completions[0].completion_tokens == 2 and time.monotonic() - start < 5
            proc.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            proc.proc.wait(30)
            assert time.monotonic() - start < 20
            assert pending.exception(10) is not None
    finally:
        proc.stop()
