"""Layer 5, what a run leaves behind: exports (a checkpoint as one file, a Hugging Face
folder, PEFT's adapter folder), the MLflow model, and the MLflow tracking glue."""
