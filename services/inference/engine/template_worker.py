"""The chat-template worker process (run by engine/template_sandbox.py; not a public command).

Reads one JSON request per line on stdin, renders it with transformers' own chat-template
renderer (a sandboxed jinja environment, the same code `apply_chat_template` runs), and writes one
JSON answer per line on stdout. It imports no torch and no model: it only renders. Its address
space is capped, so a template that builds a huge string fails here with MemoryError (or the
process dies) instead of growing the server; the server kills it when a render runs past its
time budget.
"""

from __future__ import annotations

import json
import resource
import signal
import sys


class _Overtime(Exception):
    """Raised into a render by SIGALRM once its budget is spent."""


def _overtime(signum, frame) -> None:
    raise _Overtime


def _answer(out, **fields) -> None:
    out.write(json.dumps(fields) + "\n")
    out.flush()


def main(argv: list[str]) -> int:
    memory_bytes = int(argv[0])
    from transformers.utils.chat_template_utils import render_jinja_template

    # After the imports: capping first would count the libraries being mapped against the budget.
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    out = sys.stdout
    sys.stdout = sys.stderr  # a template cannot print into the protocol
    # The worker stops a render itself when its budget is spent (the server kills it a moment
    # later anyway): a worker orphaned by a killed server then exits instead of running on.
    signal.signal(signal.SIGALRM, _overtime)
    _answer(out, ready=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            signal.setitimer(signal.ITIMER_REAL, request["timeout_s"])
            rendered, _ = render_jinja_template(
                conversations=[request["messages"]],
                chat_template=request["template"],
                add_generation_prompt=request["add_generation_prompt"],
                **request["variables"],
            )
            text = rendered[0]
        except _Overtime:
            _answer(out, error="ran past its rendering budget", kind="overtime")
            continue
        except MemoryError:
            _answer(out, error="it needed more than the renderer's memory", kind="too_large")
            continue
        except Exception as exc:  # noqa: BLE001 - whatever the template raised is the request's error
            _answer(out, error=" ".join(str(exc).split())[:500], kind="refused")
            continue
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if len(text) > request["max_chars"]:
            _answer(out, error=f"it rendered more than {request['max_chars']} characters", kind="too_large")
        else:
            _answer(out, text=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
