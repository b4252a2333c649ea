# The two commands a newcomer needs (both set everything up on a fresh machine):
#   make demo   install, start the whole service on the embedded default, run one real job, print it
#   make test   install, start Redis/PostgreSQL if they are down, run the full test suite
.PHONY: demo up test test-unit lint venv

VENV ?= .venv
PY := $(VENV)/bin/python

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)
	touch $@

demo: venv
	$(VENV)/bin/inferq up --demo

up: venv
	$(VENV)/bin/inferq up

test: venv
	bash scripts/services.sh
	$(PY) -m pytest

test-unit: venv
	$(PY) -m pytest -m "not integration"

lint: venv
	$(VENV)/bin/ruff check .
