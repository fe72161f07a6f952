"""Fixtures shared by integration test modules: the image tests' container engine (tests/integration/_image_engine.py).

Module-scoped: each module that asks for them gets its own podman service; the CPU image is built once per
test run and shared as an OCI bundle (`_image_engine.shared_bundle`, which test_oci_jobs.py reads).
"""

from _image_engine import base_image, cpu_image, engine  # noqa: F401  (fixtures, found by pytest here)
