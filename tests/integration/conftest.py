"""Fixtures shared by integration test modules: the image tests' container engine (tests/integration/_image_engine.py).

test_image_build.py asks for `engine`, `base_image` and `cpu_image`; test_oci_jobs.py for `cpu_bundle`. The CPU image
is built once per run for both (usually on different xdist workers): _image_engine.py's docstring says how.
"""

from _image_engine import (  # noqa: F401  (fixtures, found by pytest here)
    base_image,
    cpu_bundle,
    cpu_image,
    engine,
    shared_folder,
)
