"""loraplex: the one import namespace (`loraplex.services`, `loraplex.kernels`, `loraplex.adapter_store`,
`loraplex.clients`, `loraplex.bench`, and the generated stubs as `loraplex.v1`).

A wheel copies the repository's top-level folders beside this file (setup.py maps them). In a source
checkout (an editable install, or `PYTHONPATH=protos` on a machine with no install) they stay in the
repository root, two folders up, and are found through this package's path. The folders carry no
`__init__.py` of their own, so a checkout on `sys.path` never shadows another distribution's top-level
`kernels` or `services` (transformers imports Hugging Face's `kernels`).
"""

import os as _os

_checkout = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
if _os.path.isfile(_os.path.join(_checkout, "setup.py")) and _os.path.isdir(
    _os.path.join(_checkout, "services", "inference")
):
    __path__.append(_checkout)
