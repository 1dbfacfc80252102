"""The ``dilocox`` command: one console script whose subcommands start every role."""
