"""memplan subcommands (filled in below)."""


def register(add, add_model_options, config, write_json) -> None:
    return None
