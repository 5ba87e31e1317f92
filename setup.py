"""Packages of the distribution; everything else is in pyproject.toml.

The quantizer lives in the repository's top-level ``quant/`` folder and installs as ``vllm_dsv4_mtp.quant``: a
top-level ``quant`` package in site-packages would collide with any other project's. pyproject.toml alone
cannot combine package discovery with a mapped subpackage, hence this file.

The wheel carries what serves, converts, inspects and evaluates; the embedded model's training code, its float32
reference MTP and the test oracles (``embedded.training``, ``reference``, ``testing``) and its 12 MB of
checkpoints stay in the repository, where ``make demo`` and ``make test`` use them (an editable install sees the
whole tree).
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(
        include=["vllm_dsv4_mtp*"],
        exclude=["vllm_dsv4_mtp.embedded.training*", "vllm_dsv4_mtp.reference*", "vllm_dsv4_mtp.testing*"],
    )
    + ["vllm_dsv4_mtp.quant"],
    package_dir={"vllm_dsv4_mtp.quant": "quant"},
)
