"""The nginx router in front of several inference replicas, on one machine without Docker.

Renders deploy/nginx/loraplex.conf (its one variable, the listen address) with the replicas
list beside it and a minimal main nginx.conf that keeps every path (pid, temp dirs) inside a
work directory, then runs `nginx -g 'daemon off;'` as a child: no root, no /etc/nginx, no
/var/log. Used by `loraplex up --replicas N` and the tests.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

from loraplex.clients.processes import ServerProcess

ROUTER_CONF = Path(__file__).resolve().parent.parent / "deploy" / "nginx" / "loraplex.conf"
LISTEN_VARIABLE = "${LORAPLEX_ROUTER_LISTEN}"
# A replica that refused a connection is skipped for this long, then tried again.
FAIL_TIMEOUT_S = 2

MAIN_CONF = """\
worker_processes 1;
pid nginx.pid;
error_log stderr warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path client_body_temp;
    proxy_temp_path proxy_temp;
    fastcgi_temp_path fastcgi_temp;
    uwsgi_temp_path uwsgi_temp;
    scgi_temp_path scgi_temp;
    include {site};
}}
"""


def find_nginx() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    if found is None:
        raise RuntimeError("nginx is not installed: `make tools` (or `apt-get install nginx`) installs it")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def render(workdir: Path, listen: str, replicas: Sequence[str]) -> Path:
    """Write nginx.conf, loraplex.conf and loraplex-replicas.conf into `workdir`; returns nginx.conf."""
    if not replicas:
        raise ValueError("the router needs at least one replica")
    workdir.mkdir(parents=True, exist_ok=True)
    site = ROUTER_CONF.read_text()
    if LISTEN_VARIABLE not in site:
        raise RuntimeError(f"{ROUTER_CONF} has no {LISTEN_VARIABLE}")
    (workdir / "loraplex.conf").write_text(site.replace(LISTEN_VARIABLE, listen))
    (workdir / "loraplex-replicas.conf").write_text(
        "".join(f"server {r} max_fails=1 fail_timeout={FAIL_TIMEOUT_S}s;\n" for r in replicas)
    )
    main = workdir / "nginx.conf"
    main.write_text(MAIN_CONF.format(site="loraplex.conf"))
    return main


def start_router(
    workdir: Path, replicas: Sequence[str], *, host: str = "127.0.0.1", port: int = 0, echo: bool = True
) -> ServerProcess:
    """nginx listening on HOST:PORT (0 = a free port) in front of `replicas` (HOST:PORT each).

    The router's health is its replicas': wait_serving() answers once a replica is SERVING."""
    port = port or free_port(host)
    conf = render(Path(workdir), f"{host}:{port}", replicas)
    args = ["-e", "stderr", "-p", f"{conf.parent}/", "-c", str(conf), "-g", "daemon off;"]
    return ServerProcess("router", "", args, program=find_nginx(), address=f"{host}:{port}", echo=echo)
