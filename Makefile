# Two entry points: `make run` (embedded stack with the demo model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
TORCH ?= torch==2.13.0

.PHONY: install run test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"   # first, so nothing pulls a multi-GB CUDA build
	$(PY) -m pip install -q -e ".[fellow,dev]"
	touch $@

run: install
	$(VENV)/bin/swarm up

test: install
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info

# Every C kernel (fellow/runtime/kernels/csrc/*.c) compiled as native.build compiles it, plus -Werror: for
# AVX2, AVX-512 and AVX-512 with VNNI (compiling runs nothing, so any x86-64 host checks all three), into
# KERNELS_OUT, never the repo. The flags are native.FLAGS and native.AVX512 (tests/test_kernel_sources.py).
KERNELS_OUT ?= /tmp/swarm-make-kernels
KERNELS_SRC := fellow/runtime/kernels/csrc
KERNEL_FLAGS := -O3 -Wall -Wextra -mavx2 -mfma -fno-math-errno -fopenmp -shared -fPIC
KERNEL_AVX512 := -mavx512f -mavx512bw -mavx512vl -mavx512dq

.PHONY: kernels
kernels:
	@mkdir -p $(KERNELS_OUT)
	@for src in $(KERNELS_SRC)/*.c; do name=$$(basename $$src .c); \
	  for isa in avx2 avx512 avx512vnni; do \
	    case $$isa in avx2) extra="";; avx512) extra="$(KERNEL_AVX512)";; *) extra="$(KERNEL_AVX512) -mavx512vnni";; esac; \
	    $(CC) $(KERNEL_FLAGS) $$extra -Werror -I$(KERNELS_SRC) $$src -o $(KERNELS_OUT)/$$name-$$isa.so || exit 1; \
	  done; echo "kernels: $$name built for avx2, avx512, avx512vnni"; done
