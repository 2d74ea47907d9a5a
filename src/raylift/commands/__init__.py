"""Layer 7, the commands ``raylift`` runs besides train and export: tune, doctor and
submit. ``raylift.cli`` parses the command line and loads each one when it is used."""
