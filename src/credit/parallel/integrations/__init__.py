"""Adapters for the frameworks users train with: Lightning, accelerate, torchtitan.

Each module holds the few lines a recipe of the documentation's "Integrations" page needs beyond
an import swap. Importing one does not import its framework: the package depends on torch alone.
"""
