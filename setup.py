"""Packaging that pyproject.toml cannot say: the repo's top-level `conf/` ships inside the package.

`conf/` stays the single source of the config (tests compose from it); here it is mapped to the
package `prmppo.conf` (`package_dir`), so a wheel, `pip install .` and `pip install -e .` all
carry it and `python -m prmppo` finds it through the import system (`prmppo.config.paths.conf_dir`).
Everything else about the project is in pyproject.toml.
"""

from setuptools import find_namespace_packages, find_packages, setup

# prmppo.conf and one package per config group (conf/task -> prmppo.conf.task, ...)
CONF_GROUPS = find_namespace_packages("conf", exclude=["__pycache__"])
CONF_PACKAGES = ["prmppo.conf", *(f"prmppo.conf.{group}" for group in CONF_GROUPS)]

setup(
    packages=[*find_packages("src"), *CONF_PACKAGES],
    package_dir={"": "src", "prmppo.conf": "conf"},
    package_data={package: ["*.yaml"] for package in CONF_PACKAGES},
)
