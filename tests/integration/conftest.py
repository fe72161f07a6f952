"""Fixtures shared by integration test modules: the image tests' container engine (tests/integration/_image_engine.py).

Module-scoped: each module that asks for them (test_image_build.py, test_oci_jobs.py) gets its own podman
service and builds the CPU image from this checkout.
"""

from _image_engine import base_image, cpu_image, engine  # noqa: F401  (fixtures, found by pytest here)
