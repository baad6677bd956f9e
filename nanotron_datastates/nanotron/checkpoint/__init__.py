"""A checkpoint converted to and from Nanotron's stock layout: `convert` (either way, a folder to a new
one), `convert_to_stock` (into Nanotron's pickles), `convert_from_stock` (from them), `stock_pickles`
(Nanotron's `.pt` files read without unpickling). What a checkpoint on disk is (names, manifest, what a
path holds, whether it is whole) needs no Nanotron: `nanotron_datastates.checkpoint`."""
