VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install test lint format

install: $(STAMP)

$(STAMP): pyproject.toml tools/install.sh
	bash tools/install.sh
	touch $@

test: install
	$(VENV)/bin/python -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
