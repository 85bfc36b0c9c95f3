"""What the API takes and says about catalog archives."""

from __future__ import annotations

from pydantic import Field

from service.errors import RequestBody

ARCHIVE_DESCRIPTION = (
    "an archive directory written by `headcat catalog export` under the server's data directories "
    "(HEADCAT_DATA_ROOTS), or hub:OWNER/NAME[@REVISION], a data set on the Hugging Face hub (HEADCAT_ALLOW_HUB)"
)


class CatalogImportCreate(RequestBody):
    archive: str = Field(min_length=1, max_length=1000, description=ARCHIVE_DESCRIPTION)
    renames: dict[str, str] = Field(
        default_factory=dict,
        max_length=1000,
        description="archive model name -> name in this catalog, for a model already here from another commit",
    )
    models: list[str] = Field(
        default_factory=list,
        max_length=1000,
        description="import only these models of the archive (default: every model), with the clusterings all of "
        "whose models come along",
    )
