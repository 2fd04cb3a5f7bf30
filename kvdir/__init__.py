"""kvdir's command line: one `kvdir` script whose subcommands start and measure every component."""
