"""Package discovery for the one distribution `orthornn` (the rest is in pyproject.toml).

The stages keep their top-level folders (docs/design.md: the layout is fixed) and install as
`orthornn.<stage>`. setuptools' own discovery finds packages by folder name, so it
cannot follow this mapping; here each stage folder is walked with `find_packages` and
its subpackages are named under the stage's installed name. A new subfolder with an
`__init__.py` is in the next wheel without any list to update
(tests/system/test_wheel.py compares the wheel with every `.py` of these folders).
"""

from setuptools import find_packages, setup

# installed package -> folder in this repository
STAGES = {
    "orthornn": "orthornn",
    "orthornn.models": "models",
    "orthornn.training": "training",
    "orthornn.export": "export",
    "orthornn.service": "service",
}


def stage_packages() -> list[str]:
    packages = []
    for name, folder in STAGES.items():
        packages.append(name)
        packages.extend(f"{name}.{sub}" for sub in find_packages(where=folder))
    return packages


setup(packages=stage_packages(), package_dir=STAGES)
