"""The package list, found by setuptools rather than kept by hand (the rest of the metadata is in pyproject.toml).

The repository keeps one folder per format at the top level (converters/); it installs as dcptool.converters,
so no top-level module of that generic name is put on anyone's path. The link dcptool/converters ->
../converters shows tools that read the package from disk (import-linter) the same layout; the build does not
follow it (an sdist has no links), it maps the folder itself.
"""

from setuptools import find_packages, setup

formats = find_packages("converters")
setup(
    packages=[*find_packages(include=["dcptool", "dcptool.*"], exclude=["dcptool.converters", "dcptool.converters.*"]),
              "dcptool.converters", *(f"dcptool.converters.{name}" for name in formats)],
    package_dir={"dcptool.converters": "converters"},
    package_data={"dcptool.models": ["transformers_plans.json"]},  # transformers' plans, for installs without it
)
