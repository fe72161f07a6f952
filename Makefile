# hpkit: `make demo` runs a 2-node training job on a local Slurm cluster; `make test` runs the suite.
# Both install what they need on a Debian 12 machine (apt as root, pip into .venv).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(CURDIR)/$(VENV)/bin
# Jobs inherit the submitting shell's PATH (sbatch --export=ALL), so the venv reaches the nodes.
export PATH := $(BIN):$(PATH)

DEV_CLUSTER_DIR ?= $(CURDIR)/.dev-cluster
export HPKIT_DEV_CLUSTER_DIR := $(DEV_CLUSTER_DIR)
export SLURM_CONF := $(DEV_CLUSTER_DIR)/etc/slurm.conf
# The local cluster's Slurm: 22.05 (Debian 12's packages) or 24.11 (HyperPod's, run from a Debian trixie root that
# slurm/dev/slurm-root.sh builds once into ~/.cache/hpkit; its commands are wrappers in .dev-cluster/bin).
SLURM ?= 22.05
# The nodes' network: loopback (every node 127.0.0.1) or netns (a network namespace and an address per node).
NET ?= loopback
# 1: the cluster keeps accounting (its own slurmdbd; MariaDB 10.11 from Debian 12, one server per machine that
# slurm/dev/mariadb.sh starts), so sacct answers for jobs the controller has forgotten. Off by default.
ACCOUNTING ?= 0
ifeq ($(SLURM),24.11)
export PATH := $(DEV_CLUSTER_DIR)/bin:$(PATH)
endif
# Short and outside the checkout: munge's socket path must fit in a sockaddr_un (108 bytes).
TEST_TMP ?= /tmp/hpkit-test

.PHONY: help setup system-deps slurm-root venv demo demo-container test test-gpu test-unit lint cluster-up cluster-down bench bench-anchor clean

help:
	@echo "make demo         install, start the local Slurm cluster, run a 2-node training job"
	@echo "make demo-container  the same job inside the CPU image (Slurm's OCI containers, runc; root)"
	@echo "make test         install and run the whole test suite (lint included)"
	@echo "make cluster-up   start the local development cluster (NODES=2 CPUS=2 SLURM=22.05|24.11 NET=loopback|netns ACCOUNTING=0|1)"
	@echo "make cluster-down stop it"
	@echo "make test-gpu     the CUDA half of the suite (tests/gpu), on a GPU machine"
	@echo "make lint         ruff + shellcheck"
	@echo "make bench        benchmarks that print ratios measured side by side"
	@echo "make bench-anchor hpkit against torchtitan 0.2.2 (TITAN_DIR=prepared folder; ROUNDS=3)"
	@echo "make image        build the GPU training image through the Docker Engine API (image-cpu: CPU image)"
	@echo "make image-sqsh   export the image as an enroot squashfs for pyxis"

# Local development only: installs Debian packages when a command is missing.
system-deps:
	@missing=""; \
	command -v slurmctld >/dev/null || missing="$$missing slurm-wlm"; \
	command -v munged >/dev/null || missing="$$missing munge"; \
	command -v sbatch >/dev/null || missing="$$missing slurm-client"; \
	command -v mpirun >/dev/null || missing="$$missing openmpi-bin libopenmpi-dev"; \
	command -v faketime >/dev/null || missing="$$missing faketime"; \
	command -v tc >/dev/null || missing="$$missing iproute2"; \
	command -v iptables >/dev/null || missing="$$missing iptables"; \
	ls /usr/lib/*/libpmix.so >/dev/null 2>&1 || missing="$$missing libpmix-dev"; \
	if [ "$(SLURM)" = 24.11 ]; then command -v mmdebstrap >/dev/null || missing="$$missing mmdebstrap"; fi; \
	if [ "$(ACCOUNTING)" = 1 ]; then \
	  command -v slurmdbd >/dev/null || missing="$$missing slurmdbd"; \
	  command -v mariadbd >/dev/null || missing="$$missing mariadb-server"; \
	fi; \
	$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "missing Debian packages:$$missing; run: sudo apt-get install$$missing" >&2; exit 1; fi; \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing >/dev/null; \
	fi

# The modules a job's processes (rank, supervisor, zygote, torchrun agent) and the suite's workers all import.
WARM_IMPORTS = import torch, torch._dynamo, torch.distributed.run, hpkit.cli, hpkit.run_script, hpkit.runtime.run, \
  hpkit.supervise.__main__, hpkit.warm.zygote, transformers.models.llama.modeling_llama, \
  transformers.models.mixtral.modeling_mixtral, pytest, xdist

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# --no-compile: pip byte-compiles every module it installs, 30 of its 50 s here (transformers' 2,900 files and
	@# sympy's 1,500, most never imported). What every job and test imports is compiled here, once, with bytecode
	@# writes allowed (PYTHONDONTWRITEBYTECODE would leave each process compiling torch again in memory); the rest is
	@# compiled where it is first imported.
	$(BIN)/pip install -q --no-compile -e '.[train,dev,mpi,lightning,image,plot,hf,data]'
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -c '$(WARM_IMPORTS)'
	touch $@

venv: $(VENV)/.installed

setup: system-deps venv

cluster-up: system-deps
	SLURM=$(SLURM) NET=$(NET) ACCOUNTING=$(ACCOUNTING) slurm/dev/up.sh

# The Slurm 24.11 root (SLURM=24.11 clusters, and the tests marked slurm_24_11), built once per machine.
slurm-root: image-test-deps
	@slurm/dev/slurm-root.sh >/dev/null

cluster-down:
	slurm/dev/down.sh

demo: setup cluster-up
	$(BIN)/hpkit submit slurm/jobs/demo.yaml --wait --follow

# The demo job inside the CPU image: builds it (podman's Docker API where no engine answers), exports it as an
# OCI bundle (OCI_BUNDLE, default .dev-cluster/images/hpkit-cpu) and runs it with container.runtime: oci.
demo-container: setup cluster-up image-test-deps
	@if [ "$(SLURM)" = 24.11 ]; then echo "demo-container: runs on SLURM=22.05; on 24.11 OCI jobs are checked by tests/integration/test_oci_jobs.py (launcher: srun in the image), not by this demo yet" >&2; exit 2; fi
	BIN=$(BIN) scripts/demo-container.sh

lint: venv
	$(BIN)/ruff check python tests bench
	$(BIN)/ruff format --check python tests bench
	$(BIN)/shellcheck slurm/dev/*.sh scripts/*.sh docker/*.sh bench/*.sh .ci/run
	$(BIN)/deptry python --no-ansi
	$(BIN)/lint-imports --no-cache

# Five workers, whole files each (a file shares its clusters and fixtures), the longest files first
# (tests/conftest.py, tests/_file_schedule.py): with three the 2 cores were busy 1.7 of 2 on average, with four 1.75,
# idle while files waited on Slurm (requeues, node-death detection, a stopped controller). tests/_clusters.py gives
# every worker its own clusters.
# ACCOUNTING=1 for system-deps: tests/integration/test_forgotten_accounting.py starts a cluster with slurmdbd.
test: ACCOUNTING = 1
test: setup lint image-test-deps slurm-root
	rm -rf $(TEST_TMP) && mkdir -p $(TEST_TMP)
	@# Where PYTHONDONTWRITEBYTECODE is set (as on this project's machines), no process writes a .pyc, so every one of the
	@# suite's Python processes compiled each hpkit and test module it imported (~0.1 CPU-s of a rank's start-up).
	@# Bytecode written once here is read by all of them; a source edited later is simply compiled again in memory.
	$(BIN)/python -m compileall -q -j 0 python tests bench >/dev/null
	@# And pytest caches its rewrite of each test module's asserts only where bytecode may be written: without it every
	@# worker rewrote all 147 modules again (4.5 of a worker's 11.6 CPU-s of collection).
	env -u PYTHONDONTWRITEBYTECODE TMPDIR=$(TEST_TMP) $(BIN)/pytest -q -p no:cacheprovider --durations=25 -n 5 --dist loadfile tests

# The CUDA half of the suite (tests/gpu), on a machine with an NVIDIA GPU; CI has none and never collects it.
test-gpu: venv
	rm -rf $(TEST_TMP)-gpu && mkdir -p $(TEST_TMP)-gpu
	HPKIT_GPU_TESTS=1 TMPDIR=$(TEST_TMP)-gpu $(BIN)/pytest -q -p no:cacheprovider -m gpu tests/gpu

test-unit: venv
	$(BIN)/pytest -q -p no:cacheprovider tests/unit

bench: venv
	$(BIN)/python bench/run_all.py

# Not part of `make bench` or `make test`: it needs torchtitan installed in TITAN_DIR (bench/bench_vs_torchtitan.py).
bench-anchor: venv
	@test -n "$${TITAN_DIR:-}" || { echo "bench-anchor: set TITAN_DIR to a prepared torchtitan folder (see bench/bench_vs_torchtitan.py)" >&2; exit 2; }
	$(BIN)/python bench/bench_vs_torchtitan.py --rounds $${ROUNDS:-3}

include docker/image.mk

clean: cluster-down
	rm -rf $(VENV) $(TEST_TMP) $(DEV_CLUSTER_DIR) docker/wheelhouse
