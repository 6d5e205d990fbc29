"""The `loraplex` command: generate, load, unload, list, info, tokenize, health, up.

loraplex generate --adapter sql "List 3 countries and their capitals."
loraplex load sql /path/to/peft_adapter
loraplex up
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from google.protobuf.json_format import MessageToDict

from loraplex.clients import up as up_cmd
from loraplex.clients.errors import LoraplexError

DEFAULT_TARGET = "127.0.0.1:50051"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loraplex", description="loraplex: multi-LoRA LLM serving over gRPC")
    p.add_argument(
        "--target",
        default=os.environ.get("LORAPLEX_TARGET", DEFAULT_TARGET),
        help="inference service HOST:PORT (env LORAPLEX_TARGET)",
    )
    p.add_argument(
        "--store",
        default=os.environ.get("LORAPLEX_STORE"),
        help="adapter store HOST:PORT (env LORAPLEX_STORE)",
    )
    p.add_argument("--timeout", type=float, default=None, help="per-call deadline in seconds")
    p.add_argument(
        "--token",
        default=os.environ.get("LORAPLEX_TOKEN"),
        help="the server's --api-token, or --admin-token for load/unload (env LORAPLEX_TOKEN)",
    )
    p.add_argument(
        "--store-token",
        default=os.environ.get("LORAPLEX_STORE_TOKEN"),
        help="the store's admin token (env LORAPLEX_STORE_TOKEN)",
    )
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("LORAPLEX_TLS_CA"),
        help="PEM file to verify TLS servers with; plaintext without it (env LORAPLEX_TLS_CA)",
    )
    p.add_argument(
        "--tls-cert",
        default=os.environ.get("LORAPLEX_TLS_CERT"),
        help="client certificate (PEM) for servers that require one (env LORAPLEX_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key",
        default=os.environ.get("LORAPLEX_TLS_KEY"),
        help="private key of --tls-cert (env LORAPLEX_TLS_KEY)",
    )
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from one or more prompts")
    g.add_argument("text", nargs="+", help="prompts (one completion each)")
    g.add_argument(
        "--adapter",
        action="append",
        default=None,
        help="adapter name; once for all prompts or once per prompt; '' = base model",
    )
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    g.add_argument("--json", action="store_true", help="print the full response as JSON")
    g.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as one user message, rendered by the server with the model's chat "
        "template (the adapter's own when it ships one)",
    )
    g.add_argument("--system", default=None, help="with --chat: a system message before each prompt")
    g.add_argument(
        "--ids", action="store_true", help="the prompts are token ids, comma-separated (e.g. 1,2,3)"
    )
    g.add_argument(
        "-n", type=int, default=None, help="completions per prompt (seeded: seed + j for sample j)"
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="log probabilities of the generated tokens and K alternatives (shown with --json)",
    )

    ld = sub.add_parser("load", help="load an adapter (registers it in the store when the server has one)")
    ld.add_argument("name")
    ld.add_argument("source", help="local directory, file:// URI, hf://org/repo or org/repo")
    ld.add_argument("--revision", default="")
    ld.add_argument("--pin", action="store_true", help="keep it resident on the GPU")

    ul = sub.add_parser("unload", help="unload an adapter from the inference service")
    ul.add_argument("name")
    ls = sub.add_parser("list", help="adapters: where they live, pinned, requests in flight")
    ls.add_argument("--json", action="store_true")
    sub.add_parser("info", help="the model and LoRA configuration of the server")
    tk = sub.add_parser("tokenize", help="token ids of a text, as the server's tokenizer gives them")
    tk.add_argument("text")
    sub.add_parser("health", help="grpc.health.v1 status of the inference service")
    up_cmd.add_arguments(sub.add_parser("up", help="start embedded Redis, the adapter store and inference"))
    return p


def _sampling(ns: argparse.Namespace) -> dict:
    keys = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n")
    out = {k: getattr(ns, k) for k in keys if getattr(ns, k) is not None}
    if ns.ignore_eos:
        out["ignore_eos"] = True
    if ns.logprobs is not None:
        out.update(logprobs=True, top_logprobs=ns.logprobs)
    return out


def _request(ns: argparse.Namespace):
    """The GenerateRequest for `generate`: one input per prompt (text, token ids or a chat)."""
    from loraplex.clients.requests import generate_request, inputs_request

    adapters = ns.adapter or []
    if not (ns.ids or ns.chat):  # plain texts: the server checks the adapter list
        return generate_request(ns.text, adapters or None, **_sampling(ns))
    if len(adapters) not in (0, 1, len(ns.text)):
        print(f"error: --adapter given {len(adapters)} times for {len(ns.text)} prompts", file=sys.stderr)
        raise SystemExit(2)
    inputs = []
    for i, text in enumerate(ns.text):
        if ns.ids:
            item = {"token_ids": [int(t) for t in text.replace(",", " ").split()]}
        elif ns.chat:
            system = [{"role": "system", "content": ns.system}] if ns.system else []
            item = {"messages": [*system, {"role": "user", "content": text}]}
        else:
            item = {"text": text}
        if len(adapters) == len(ns.text) > 1:
            item["adapter"] = adapters[i]
        inputs.append(item)
    default = adapters[0] if len(adapters) == 1 else None
    return inputs_request(inputs, default, **_sampling(ns))


def _generate(client, ns: argparse.Namespace) -> None:
    request = _request(ns)
    many = len(ns.text) > 1 or (ns.n or 1) > 1
    if ns.stream:
        finals = {}
        for delta in client.generate_stream(request):
            if ns.json:
                print(json.dumps(MessageToDict(delta)), flush=True)
                continue
            prefix = f"[{delta.index}.{delta.sample}] " if many else ""
            if delta.text:
                sys.stdout.write(prefix + delta.text if prefix else delta.text)
                sys.stdout.flush()
            if delta.finish_reason:
                finals[(delta.index, delta.sample)] = delta
                if prefix:
                    sys.stdout.write("\n")
        if not ns.json:
            sys.stdout.write("\n")
        return
    completions = client.generate_request(request)
    if ns.json:
        print(json.dumps([MessageToDict(c) for c in completions], indent=2))
        return
    for c in completions:
        if many:
            print(
                f"--- [{c.index}.{c.sample}] adapter={c.adapter or 'base'} finish={c.finish_reason} "
                f"tokens={c.completion_tokens} ttft={c.time_to_first_token_s * 1000:.0f}ms"
            )
        print(c.text)


def _list(client, ns: argparse.Namespace) -> None:
    adapters = client.list_adapters()
    if ns.json:
        print(json.dumps([MessageToDict(a) for a in adapters], indent=2))
        return
    print(f"{'NAME':24} {'LOCATION':9} {'RANK':>4} {'ALPHA':>6} {'PIN':3} {'IN-FLIGHT':>9}  TARGETS")
    for a in adapters:
        loc = {1: "gpu", 2: "host", 3: "store"}.get(a.location, "?")
        print(
            f"{a.name:24} {loc:9} {a.rank:>4} {a.alpha:>6g} {'yes' if a.pinned else 'no':3} "
            f"{a.requests_in_flight:>9}  {','.join(a.target_modules)}"
        )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.command == "up":
        return up_cmd.run(ns)
    from loraplex.clients.client import Client

    try:
        with Client(
            ns.target,
            store=ns.store,
            timeout=ns.timeout,
            token=ns.token,
            store_token=ns.store_token,
            tls_ca=ns.tls_ca,
            tls_cert=ns.tls_cert,
            tls_key=ns.tls_key,
        ) as client:
            if ns.command == "generate":
                _generate(client, ns)
            elif ns.command == "load":
                info = client.load_adapter(ns.name, ns.source, ns.revision, ns.pin)
                print(json.dumps(MessageToDict(info), indent=2))
            elif ns.command == "unload":
                client.unload_adapter(ns.name)
                print(f"unloaded {ns.name}")
            elif ns.command == "list":
                _list(client, ns)
            elif ns.command == "info":
                print(json.dumps(MessageToDict(client.model_info()), indent=2))
            elif ns.command == "tokenize":
                print(json.dumps(client.tokenize(ns.text)))
            elif ns.command == "health":
                print(client.health())
    except LoraplexError as exc:
        print(f"error: {exc}", file=sys.stderr)
        for field, why in exc.field_violations.items():
            print(f"  {field}: {why}", file=sys.stderr)
        return 2 if exc.code.name == "INVALID_ARGUMENT" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
