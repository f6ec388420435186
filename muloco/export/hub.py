"""An exported folder uploaded to a Hugging Face Hub model repository in one commit; the token is
huggingface_hub's own lookup, never a flag, never printed or written."""

from __future__ import annotations

from pathlib import Path

from muloco.export.folder import ExportError


def hub_token(repo: str) -> str:
    """The token for ``repo`` as huggingface_hub finds it (``HF_TOKEN``, or what ``hf auth login``
    saved); the name and the token are checked before anything is exported."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ExportError(f"--push-to-hub {repo!r}: give the repository as OWNER/NAME")
    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        raise ExportError(f"--push-to-hub {repo!r} is not a valid Hub repository name: {str(err).splitlines()[0]}")
    token = get_token()
    if not token:
        raise ExportError(
            "--push-to-hub needs a Hub token: run `hf auth login` once, or export HF_TOKEN=... "
            "(never on the command line)"
        )
    return token


def push_to_hub(folder: Path, repo: str, *, private: bool) -> str:
    """Upload ``folder`` to the Hub repository ``repo`` in one commit; the commit's URL."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=hub_token(repo))
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    later = "The folder was written and can be pushed later"
    try:
        api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        if private and not api.repo_info(repo, repo_type="model").private:
            raise ExportError(
                f"--push-to-hub {repo} --private: that repository exists and is public; nothing was "
                f"uploaded. Make it private on the Hub or push to another one. {later}"
            )
        info = api.create_commit(
            repo,
            [CommitOperationAdd(str(p.relative_to(folder)), str(p)) for p in files],
            commit_message=f"muloco export ({len(files)} files)",
            repo_type="model",
        )
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "no response"
        raise ExportError(
            f"--push-to-hub {repo}: the Hub refused the upload ({status}); check that your Hub token "
            f"(HF_TOKEN or `hf auth login`) may write to {repo}. {later}"
        ) from None
    except ExportError:
        raise
    except Exception as e:  # the Hub client's network and validation errors have no common base
        raise ExportError(f"--push-to-hub {repo}: the upload failed ({type(e).__name__}: {e}). {later}") from None
    return info.commit_url
