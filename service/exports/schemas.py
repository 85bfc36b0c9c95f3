"""The export formats and score names, with the words the OpenAPI page shows for them."""

from __future__ import annotations

from typing import Literal, get_args

ExportFormat = Literal["prune_heads", "head_mask", "head_mask.npy", "scores", "pairs", "csv"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = get_args(ExportFormat)

# Scores derived from the distance vector (SPEC section 2) or from the clustering.
DerivedScore = Literal["special", "local", "centroid_distance", "margin", "agreement"]
DERIVED_SCORES: tuple[DerivedScore, ...] = get_args(DerivedScore)
DEFAULT_SCORE = "special"

FORMAT_DESCRIPTION = """\
What to return; the selected heads are the heads to **prune**:

- `prune_heads`: `{"layer": [head, ...]}` for the layers with selected heads, heads ascending:
  the form of `config.json`'s `pruned_heads` and of `transformers`' `model.prune_heads(...)`
  (JSON keys are strings; `{int(k): v for k, v in d.items()}` gives the Python form).
- `head_mask`: `[layers][heads]` of 0/1, **1 = keep**, 0 = pruned (the selection).
- `head_mask.npy`: the same mask as a float32 `.npy` array of shape `(layers, heads)`.
- `scores`: `[layers][heads]` of floats, the `score` quantity of each head; heads outside the
  selection are `null`.
- `pairs`: `[[layer, head], ...]` of the selected heads, sorted.
- `csv`: one row per selected head: `model, layer, head, type, clustering_id, feature_run_id,
  score_<score>`, then the features and the scalars by name.
"""

SCORE_DESCRIPTION = """\
The quantity of the `scores` form (and of the csv's `score_<score>` column): `special` (default: the
head's attention mass on `[CLS]`, `[SEP]`, `.` and `,`, i.e. cls + sep + period + comma, the
mass that makes a head vertical; Clark et al. 2019 find such attention to be mostly a no-op),
`local` (self + w0 + w1, the mass that makes a head diagonal), `centroid_distance` (Euclidean
distance of the head's distance vector to its cluster's centroid: 0 is the most typical head of
its type; needs a clustering), `margin` (how far the head sits from its cluster's border,
`(d2 - d1) / max(d1, d2)` with `d1` the distance to its own centroid and `d2` to the nearest other: 1 on the
centroid, 0 exactly between two), `agreement` (the share of the clustering's current stability run's fits that
give the head its type; needs a stability run), a detector score of the model's current detection run
(`induction`, `duplicate_token`, `previous_token`, `sink`; SPEC 10), any feature
by name (`w0`..`w15`, `self`, `cls`, `sep`, `period`, `comma`) or scalar (`entropy`,
`prev_token`, `next_token`, `mean_distance`, `sep_to_sep`). Values are raw: no direction
(important / prunable) is implied.
"""

SELECTION_DESCRIPTION = """\
Export a selection of one model's heads for pruning tools (SPEC section 5).

**Selection.** A head is selected when it passes *every* filter given: `type` (any of the
listed types; repeat the parameter or give a comma list), `exclude_type` (none of them),
`layer_gt`/`layer_ge`/`layer_lt`/`layer_le`, `head`, `heads` (an explicit `L:H,L:H`
list; an empty `heads=` selects no head), `role` (any of the listed roles in the model's
current detection run: `induction`, `duplicate_token`, `previous_token`, `sink`), and the confidence in the
head's type: `min_agreement` (its agreement in the clustering's current stability run is at least this; needs
a stability run: `headcat stability CLUSTERING`) and `min_margin` (its margin is at least this), so that a
pruning tool can keep to the heads whose type is certain. With no filter, every head is selected. Types come
from `clustering` (an id; it must include the model) or else the model's current clustering;
an unclustered model can be exported with layer and head filters only. Layers and heads are
0-based, as in `transformers`.

**Forms.** The selection is the set of heads to prune: `prune_heads` and `pairs` list it,
`head_mask` is 1 for heads to keep and 0 for selected heads. The response headers
`X-Headcat-Clustering` (the clustering used, or `none`) and `X-Headcat-Selected` (how many
heads are selected) say what was exported.

**Stacks.** A head is `(stack, layer, head)` (`encoder`, `decoder`, `cross`; layers count within
their stack). `stack` limits the export to one stack; by default it covers every stack of the
model, and layer/head filters apply within each. One stack (a single-stack model, or `stack`
given): the forms above. Several: each JSON form is `{stack: form}` (e.g. `prune_heads` is
`{"encoder": {"0": [3]}, "decoder": {...}, "cross": {...}}`, `head_mask` one mask per stack, for
`head_mask`/`decoder_head_mask`/`cross_attn_head_mask` style inputs), `pairs` are
`[stack, layer, head]`, `csv` has a `stack` column (always, as its last column), and
`head_mask.npy` needs `stack`.

Bad input (an unknown format, type or score, a layer or head out of range, a malformed
`heads` list, a clustering that does not include the model) is a 4xx naming the field.
"""
