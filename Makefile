# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The stamp is rebuilt whenever the project's dependencies change.
STAMP := $(VENV)/.installed-stamp

.PHONY: run test bench screenshots clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -e '.[gui,quant,test]'
	$(BIN)/python -m hivekeeper.core.runtime.default_model install
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/hivekeeper app

test: $(STAMP)
	$(BIN)/python -m pytest

# PNGs of each page at 1280x800, with a local demo swarm running, into docs/screenshots/
screenshots: $(STAMP)
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m hivekeeper.gui.screenshots --out docs/screenshots

bench: $(STAMP)
	for b in bench/[!_]*.py; do echo "# $$b"; $(BIN)/python $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
