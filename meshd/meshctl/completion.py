"""Shell completion for meshctl, written from its argparse parser (so it
never falls behind a new command or option): commands, subcommands, options,
the choices an option takes, and node names (`meshctl config nodes`) where a
command takes nodes. Bash; zsh through its bash compatibility."""

from __future__ import annotations

import argparse

NODE_COMMANDS = ("logs", "reboot", "agents install")  # their positionals are node names


def tree(parser: argparse.ArgumentParser) -> dict[str, dict]:
    """{"": the top level, "cmd": ..., "cmd sub": ...} -> {"words": what may come next (options, subcommands,
    a positional's choices), "commands": the subcommands, "choices": {option: its choices}}."""
    out: dict[str, dict] = {}

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        words, commands, choices = [], [], {}
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    commands.append(name)
                    walk(child, f"{path} {name}".strip())
            elif action.option_strings:
                words += [o for o in action.option_strings if o.startswith("--")]
                if action.choices:
                    choices.update({o: list(action.choices) for o in action.option_strings})
            elif action.choices:
                words += list(action.choices)
        out[path] = {"words": words + commands, "commands": commands, "choices": choices}

    walk(parser, "")
    return out


def bash(parser: argparse.ArgumentParser) -> str:
    cases = []
    for path, node in tree(parser).items():
        extra = " $(meshctl config nodes 2>/dev/null)" if path in NODE_COMMANDS else ""
        prev = "".join(f'\n                {opt}) COMPREPLY=($(compgen -W "{" ".join(c)}" -- "$cur")); return;;'
                       for opt, c in node["choices"].items())
        takes = f'            case "$prev" in{prev}\n            esac\n' if prev else ""
        cases.append(f'        "{path}")\n{takes}            words="{" ".join(node["words"])}{extra}";;')
    return f"""# meshctl completion for bash: source <(meshctl completion bash)
_meshctl() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" path="" words="" i w
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        case "$w" in
            --config) ((i++));;
            -*) ;;
            *) case " $(_meshctl_children "$path") " in *" $w "*) path="${{path:+$path }}$w";; esac;;
        esac
    done
    [ "$prev" = --config ] && return  # a file: readline's own completion (-o default)
    case "$path" in
{chr(10).join(cases)}
    esac
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
_meshctl_children() {{
    case "$1" in
{chr(10).join(f'        "{path}") echo "{" ".join(node["commands"])}";;' for path, node in tree(parser).items()
              if node["commands"])}
    esac
}}
complete -o default -F _meshctl meshctl"""


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    if shell == "zsh":
        return ("# meshctl completion for zsh: source <(meshctl completion zsh)\n"
                "autoload -U +X bashcompinit && bashcompinit\n" + bash(parser))
    return bash(parser)
