"""Maps the repository's top-level folders to one import namespace, `loraplex` (pyproject.toml holds
the rest).

The folders stay where the design puts them; installed (wheel or editable), they import as
`loraplex.services`, `loraplex.kernels`, `loraplex.adapter_store`, `loraplex.clients`, `loraplex.bench`, and
the generated stubs as `loraplex.v1`. Subpackages are found, not listed, so a new one needs no edit here.
"""

from setuptools import find_packages, setup

# namespace package -> folder
FOLDERS = {
    "loraplex": "protos/loraplex",
    "loraplex.services": "services",
    "loraplex.kernels": "kernels",
    "loraplex.adapter_store": "adapter_store",
    "loraplex.clients": "clients",
    "loraplex.bench": "bench",
}

packages = []
for name, folder in FOLDERS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(where=folder)]

setup(packages=packages, package_dir=FOLDERS, package_data={"loraplex.clients": ["grpcurl/*.sh"]})
