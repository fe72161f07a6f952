# Container image targets; the main Makefile includes this file and defines BIN (the venv's bin folder) and
# PYTHON. Every build goes through the Docker Engine API at DOCKER_HOST (Docker, or podman's service: see
# scripts/podman-service.sh), so the same targets work on a workstation and on a login node.
#
#   make image                 the GPU image (docker/Dockerfile), tagged with docker/versions.env
#   make image-cpu             the CPU image; IMAGE_BASE=hpkit-base:bookworm where no registry is reachable
#   make image-base            make and import that base with mmdebstrap (local, root)
#   make image-sqsh            the GPU image (or IMAGE=...) as an enroot squashfs for pyxis
#   make image-test-deps       podman, runc, mmdebstrap for the image integration test (root, only if missing)

IMAGE_REPO ?= hpkit
# The base of the CPU image; empty means the Dockerfile's default (debian:<release>-slim from a registry).
IMAGE_BASE ?=
IMAGE_BASE_TAG ?= hpkit-base:bookworm
IMAGE_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/hpkit
IMAGE_BUILD_FLAGS ?=
IMAGE ?=
SQSH ?=
IMAGE_TEST_PACKAGES := podman runc mmdebstrap

.PHONY: image image-cpu image-base image-sqsh image-test-deps image-env

# Building an image needs hpkit and the docker SDK, not torch or the test tools: on a login node this
# installs only those into .venv (a full `make setup` venv already has them).
image-env: $(VENV)/.installed-image

$(VENV)/.installed-image: pyproject.toml
	@if [ ! -f $(VENV)/.installed ] || [ pyproject.toml -nt $(VENV)/.installed ]; then \
	  $(PYTHON) -m venv $(VENV) && $(BIN)/pip install -q -e '.[image]'; \
	fi
	touch $@

image: image-env
	@$(BIN)/hpkit image build --repo $(IMAGE_REPO) $(IMAGE_BUILD_FLAGS)

image-cpu: image-env
	@$(BIN)/hpkit image build --cpu --repo $(IMAGE_REPO) $(if $(IMAGE_BASE),--base-image $(IMAGE_BASE)) \
	  $(IMAGE_BUILD_FLAGS)

image-base: image-env
	docker/mkbase.sh $(IMAGE_CACHE)/base-bookworm.tar bookworm
	@$(BIN)/hpkit image import-base $(IMAGE_CACHE)/base-bookworm.tar --tag $(IMAGE_BASE_TAG)
	@echo "now: make image-cpu IMAGE_BASE=$(IMAGE_BASE_TAG)"

image-sqsh: image-env
	@image="$(IMAGE)"; \
	if [ -z "$$image" ]; then image=$$($(BIN)/hpkit image tags --repo $(IMAGE_REPO) | head -n 1); fi; \
	scripts/enroot-import.sh "$$image" $(SQSH)

# Used by `make test` before the image integration test; installs nothing when everything is there, and only
# warns (the test then skips, saying why) when it cannot install as a non-root user.
image-test-deps:
	@missing=""; \
	for pkg in $(IMAGE_TEST_PACKAGES); do command -v $$pkg >/dev/null || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "image tests need Debian packages:$$missing; run: sudo apt-get install --no-install-recommends$$missing" >&2; \
	  else \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing >/dev/null; \
	  fi; \
	fi
