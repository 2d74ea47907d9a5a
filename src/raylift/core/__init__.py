"""Layer 1, what every other layer may use: the config schema and its parsing, one-line
errors, storage (local folders and object stores), the console, the run lock, the
process's start-up clock, and the names several layers share. Imports no other layer."""
