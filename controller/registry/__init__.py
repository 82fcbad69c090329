"""Model registry: uploads, the artifact store, checks, bundled models, variant builds and fidelity."""
