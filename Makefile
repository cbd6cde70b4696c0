VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install test lint format demo

install: $(STAMP)

$(STAMP): pyproject.toml tools/install.sh
	bash tools/install.sh
	touch $@

test: install
	$(VENV)/bin/python -m pytest -q

# The main job: 2-process training of the small synthetic DLRM, about a minute.
demo: install
	$(VENV)/bin/embshard train configs/small.yaml --nproc 2

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
