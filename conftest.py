"""Root pytest configuration.

`pytest --nbval lessons/` must compare the executed lessons only: the generated exercise
notebooks have no stored outputs (students run them) and are checked by tests/exercises.
"""

collect_ignore_glob = ["lessons/exercises/*", "lessons/build/*", ".venv/*", "book/_build/*"]
