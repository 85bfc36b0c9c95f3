"""``/syntax-runs`` and ``/models/{name}/syntax``: start syntax jobs and read the syntax heads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, status

from service.auth.deps import KEY_RESPONSES, RequireKey
from service.deps import SessionDep
from service.jobs.endpoints import accept
from service.jobs.schemas import JobAccepted
from service.sources import data_file
from service.syntax import service
from service.syntax.schemas import ModelSyntax, SyntaxCreate, SyntaxRunRead

router = APIRouter(tags=["syntax"])

Id = Annotated[int, Path(ge=1, le=2**31 - 1)]
ModelName = Annotated[str, Path(description="the model's unique catalog name", max_length=200)]


@router.post(
    "/syntax-runs",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobAccepted,
    dependencies=[RequireKey],
    responses=KEY_RESPONSES,
)
def create_syntax_run(body: SyntaxCreate, session: SessionDep, request: Request) -> JobAccepted:
    """Queue a syntax run on the ``gpu`` queue; ``GET /jobs/{id}`` shows sentences done of total.

    ``parses`` (a CoNLL-U file under the server's data directories) gives gold parses; otherwise
    ``corpus`` is parsed by spaCy (silver; the server needs the ``[syntax]`` extra). Checked
    before anything is queued: the model, the CoNLL-U file line by line (a malformed line is
    named), or the corpus (a sentence of two words) and spaCy's presence.
    """
    settings = request.app.state.settings
    update = {"corpus": data_file(body.corpus, settings, "corpus")}
    if body.parses is not None:
        update["parses"] = data_file(body.parses, settings, "parses")
    body = body.model_copy(update=update)
    service.validate(session, body)
    return accept(session, request, "syntax", body.model_dump(mode="json"))


@router.get("/syntax-runs/{run_id}", response_model=SyntaxRunRead)
def get_syntax_run(session: SessionDep, run_id: Id) -> SyntaxRunRead:
    """One run: its parses and each relation's pair count and fixed-offset baseline."""
    return service.get_run(session, run_id)


@router.get("/models/{name}/syntax", response_model=ModelSyntax)
def get_model_syntax(
    session: SessionDep,
    name: ModelName,
    min_count: Annotated[int, Query(ge=1, le=1_000_000, description="relations with at least this many pairs")] = 1,
) -> ModelSyntax:
    """The best head per relation against its fixed-offset baseline (Clark et al. Fig. 5 as data),
    from the model's current syntax run, and the relations x heads accuracy matrix."""
    return service.model_syntax(session, name, min_count=min_count)
