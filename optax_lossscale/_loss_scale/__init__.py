"""The loss scale: state machine, transformations, finite check, record, guard."""
