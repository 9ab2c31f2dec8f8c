# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The stamp is rebuilt whenever the project's dependencies change.
STAMP := $(VENV)/.installed-stamp

.PHONY: run test bench screenshots mutate clean-venv package dists bundle deb

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -e '.[gui,quant,test]'
	$(BIN)/python -m hivekeeper.core.runtime.default_model install
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/hivekeeper app

# PYTEST_ARGS: pytest options. By default the suite runs on pytest-xdist workers (-n auto: one per CPU, at most 4, none
# on a one-CPU machine; --dist loadfile keeps a file's shared fixtures on one worker). PYTEST_ARGS= runs it in one
# process (docs/testing.md, "Workers").
PYTEST_ARGS ?= -n auto --dist loadfile
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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

# `make package`: everything a release ships, built and checked (packaging/README.md), into dist/:
# 1. the wheel and sdist, built from the files git tracks (offline, packaging/build_dists.py); the wheel's file list is
#    checked against the tree, and it is installed into a fresh venv to run --version, plan, demo-model and generate;
# 2. the frozen bundle dist/hivekeeper/ of that wheel (PyInstaller, the `package` extra; minutes: torch and Qt are
#    analysed);
# 3. its .deb (without dpkg-deb: skipped, saying so), installed into a scratch root with dpkg --root and compared with
#    the bundle; then the installed copy (or, without dpkg, the bundle) runs --version, plan, demo-model, generate and
#    the app to its first paint (packaging/check_deb.py, check_bundle.py).
# DEB_COMPRESSION: xz (smallest, slowest: minutes on a GB), gzip, zstd or none (.ci/run: none, a check, not a release)
PACKAGE_STAMP := $(VENV)/.package-stamp
DEB_COMPRESSION ?= xz

$(PACKAGE_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[gui,quant,test,package]'
	touch $(PACKAGE_STAMP)

package: dists bundle deb

dists: $(STAMP)
	rm -f dist/hivekeeper-*.whl dist/hivekeeper-*.tar.gz
	$(BIN)/python packaging/build_dists.py --out dist
	$(BIN)/python packaging/check_wheel.py dist/hivekeeper-*.whl --install

# the bundle freezes the wheel's Hivekeeper, unpacked into build/bundle-src (packaging/pyinstaller.spec says why)
bundle: dists $(PACKAGE_STAMP)
	rm -rf dist/hivekeeper build/bundle-src
	$(BIN)/python -m pip install --quiet --no-deps --no-index --target build/bundle-src dist/hivekeeper-*.whl
	HIVEKEEPER_BUNDLE_SOURCE=$(CURDIR)/build/bundle-src $(BIN)/pyinstaller --noconfirm --log-level WARN \
		--distpath dist --workpath build/pyinstaller packaging/pyinstaller.spec

deb: bundle
	rm -f dist/hivekeeper_*.deb
	@if command -v dpkg-deb >/dev/null && command -v dpkg >/dev/null; then \
		DEB_COMPRESSION=$(DEB_COMPRESSION) packaging/deb/build_deb.sh dist/hivekeeper dist && \
		$(BIN)/python packaging/check_deb.py dist/hivekeeper_*.deb dist/hivekeeper --run; \
	else \
		echo "make deb: no .deb: dpkg-deb or dpkg is not installed (a Debian-family tool); checking the bundle alone"; \
		$(BIN)/python packaging/check_bundle.py dist/hivekeeper; \
	fi

clean-venv:
	rm -rf $(VENV)
