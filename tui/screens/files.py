"""`FileScreen`: the open / save / save-as actions of the editor screen, with file I/O in thread workers.

Reading and writing go through `tui.textfile.TextFile` (exact bytes, a `NAME~` backup on overwrite) in thread
workers that report back with `FileLoaded` / `FileSaved` / `Problem` messages; the subclass decides what a
loaded document means for the server (`document_replaced`).
"""

from __future__ import annotations

from pathlib import Path

from textual import on, work

from tui.messages import FileLoaded, FileSaved, Problem
from tui.screens.base import EditorScreen
from tui.screens.prompt import PromptScreen
from tui.textfile import TextFile, TextFileError


class FileScreen(EditorScreen):
    def document_replaced(self, file: TextFile, text: str) -> None:
        """Hook: a file was opened (the subclass makes it the server document)."""
        raise NotImplementedError

    def action_open(self) -> None:
        note = "Unsaved changes here will be lost (Esc, then Ctrl+S to save)." if self.dirty else ""
        start = str(self.dapp.textfile.path.parent) + "/" if self.dapp.textfile.path else str(Path.cwd()) + "/"

        def answer(path: str | None) -> None:
            if path:
                self.load_file(path)

        self.app.push_screen(PromptScreen("Open file:", start, note=note), answer)

    @work(thread=True, exclusive=True, group="file", exit_on_error=False)
    def load_file(self, path: str) -> None:
        try:
            file, text = TextFile.load(path)
        except TextFileError as e:
            self.post_message(Problem(f"Cannot open: {e}"))
            return
        self.post_message(FileLoaded(file, text))

    @on(FileLoaded)
    def _loaded(self, msg: FileLoaded) -> None:
        self.saved_text = msg.text
        self.document_replaced(msg.file, msg.text)
        new = "" if msg.file.path is not None and msg.file.path.exists() else " (new file)"
        self.notify(f"Opened {msg.file.name}{new}.")
        for warning in msg.file.warnings:
            self.notify(warning, severity="warning", timeout=10)

    def action_save(self) -> None:
        if self.dapp.textfile.path is None:
            self.action_save_as()
        else:
            self.save_file(None, self.editor.doc_text)

    def action_save_as(self) -> None:
        current = self.dapp.textfile.path
        start = str(current) if current is not None else str(Path.cwd()) + "/"

        def answer(path: str | None) -> None:
            if path:
                self.save_file(path, self.editor.doc_text)

        self.app.push_screen(PromptScreen("Save as:", start), answer)

    @work(thread=True, exclusive=True, group="file", exit_on_error=False)
    def save_file(self, path: str | None, text: str) -> None:
        try:
            written, backup = self.dapp.textfile.save(text, path)
        except TextFileError as e:
            self.post_message(Problem(f"Not saved: {e}"))
            return
        self.post_message(FileSaved(written, backup, text))

    @on(FileSaved)
    def _saved(self, msg: FileSaved) -> None:
        self.saved_text = msg.text
        extra = f" (the previous version is in {msg.backup.name})" if msg.backup is not None else ""
        self.notify(f"Saved {msg.path.name}{extra}.")
        self.after_save()

    def after_save(self) -> None:
        """Hook: the subclass refreshes its status bar."""
