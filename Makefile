# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The stamp is rebuilt whenever the project's dependencies change.
STAMP := $(VENV)/.installed-stamp

.PHONY: run test bench screenshots mutate clean-venv package

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

# Mutation testing (docs/testing.md), not part of `make test`: mutmut on the modules where a silent bug hurts most,
# one scope at a time within its time limit (pyproject.toml, [tool.mutmut.scopes]). Results are cached in
# build/mutate/: a later run tests only the mutants of changed functions. `make mutate MUTATE_SCOPES=policy` runs one.
MUTATE_STAMP := $(VENV)/.mutate-stamp
MUTATE_JOBS ?= 2
MUTATE_SCOPES ?=

$(MUTATE_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[gui,quant,test,mutate]'
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	$(BIN)/python tests/mutate.py --jobs $(MUTATE_JOBS) $(MUTATE_SCOPES)

# The wheel and sdist into dist/, built from the files git tracks (offline, packaging/build_dists.py); then the wheel
# is checked: its file list against the tree, and installed into a fresh venv to run plan, demo-model and generate
# (packaging/check_wheel.py). The frozen bundle and the .deb have recipes in packaging/ (packaging/README.md).
package: $(STAMP)
	rm -f dist/hivekeeper-*.whl dist/hivekeeper-*.tar.gz
	$(BIN)/python packaging/build_dists.py --out dist
	$(BIN)/python packaging/check_wheel.py dist/hivekeeper-*.whl --install

clean-venv:
	rm -rf $(VENV)
