//! Chat templates: the Jinja program in a model dir that turns a list of messages into the exact
//! text the model was trained on.
//!
//! The environment copies HF transformers' (`utils/chat_template_utils.py::_compile_jinja_template`):
//! `trim_blocks` and `lstrip_blocks` on, the trailing newline of the template dropped, loop
//! controls, Python string/dict methods (`.startswith`, `.strip`, `.split`, `.items()`, ...), and the
//! `raise_exception`, `strftime_now` and `tojson` HF adds. Rendering gets the same variables HF
//! passes: `messages`, `add_generation_prompt`, `tools = none`, `documents = none`, and the special
//! tokens `bos_token`, `eos_token`.

mod compat;

use crate::error::{EncodeError, TextError};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{context, Environment, Value};
use serde::{Deserialize, Serialize};

/// One chat turn, as in `{"role": "user", "content": "Hi"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ... (the template decides which it accepts).
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Name of the one template registered in the environment; shows up in minijinja's error text.
const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template plus the special-token strings it is rendered with.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from, for error messages (e.g. `".../tokenizer_config.json"`).
    origin: String,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`. `origin` names where it came from (a file path) for error messages;
    /// `bos_token` / `eos_token` are the tokenizer's token strings (rendered as `""` when `None`).
    pub fn new(
        source: impl Into<String>,
        origin: impl Into<String>,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, TextError> {
        let source = source.into();
        let origin = origin.into();
        let syntax_err = |e: minijinja::Error| TextError::TemplateSyntax {
            origin: origin.clone(),
            message: error_text(&e),
        };

        let mut env = Environment::new();
        // HF: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True); Jinja's default
        // keep_trailing_newline=False.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(syntax_err)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", compat::raise_exception);
        env.add_function("strftime_now", compat::strftime_now);
        env.add_filter("tojson", compat::tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(syntax_err)?;

        Ok(Self {
            env,
            origin,
            source,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Where the template was read from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Renders `messages`; with `add_generation_prompt` the template appends the header that opens
    /// the next assistant turn (e.g. `<|im_start|>assistant\n`).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, EncodeError> {
        let template_err = |e: minijinja::Error| EncodeError::Template {
            origin: self.origin.clone(),
            message: error_text(&e),
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(template_err)?;
        let ctx = context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            // HF passes tools=None and documents=None explicitly, so `tools is none` is true.
            tools => Value::from(()),
            documents => Value::from(()),
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        template.render(ctx).map_err(template_err)
    }
}

/// minijinja's error with its cause chain on one line.
fn error_text(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tpl(src: &str) -> ChatTemplate {
        ChatTemplate::new(src, "test", Some("<s>"), Some("</s>")).unwrap()
    }

    fn msgs() -> Vec<Message> {
        vec![
            Message::new("system", "  Be brief.  "),
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello!"),
        ]
    }

    /// A ChatML-style template written over several lines, as real ones are: with trim_blocks and
    /// lstrip_blocks only the explicit `\n`s inside `{{ }}` survive.
    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        let src = "{{ bos_token }}\n\
                   {% for m in messages %}\n    \
                       {% if m.role == 'system' %}\n        \
                           {{ '<|sys|>' + m.content.strip() + '\\n' }}\n    \
                       {% else %}\n        \
                           {{ '<|' + m.role + '|>' + m['content'] + '\\n' }}\n    \
                       {% endif %}\n\
                   {% endfor %}\n\
                   {% if add_generation_prompt %}\n    \
                       {{ '<|assistant|>' }}\n\
                   {% endif %}\n";
        let t = tpl(src);
        // `{{ bos_token }}\n` is a variable tag: its newline is kept (trim_blocks is for blocks).
        // The `{{ }}` lines keep their leading spaces (lstrip_blocks is for blocks only) and
        // their newline.
        assert_eq!(
            t.render(&msgs(), false).unwrap(),
            "<s>\n        <|sys|>Be brief.\n\n        <|user|>Hi\n\n        <|assistant|>Hello!\n\n"
        );
        assert_eq!(
            t.render(&msgs()[..2], true).unwrap(),
            "<s>\n        <|sys|>Be brief.\n\n        <|user|>Hi\n\n    <|assistant|>\n"
        );
    }

    #[test]
    fn trailing_newline_dropped_and_specials_empty_when_absent() {
        let t = ChatTemplate::new("[{{ bos_token }}|{{ eos_token }}]\n", "t", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "[|]");
    }

    #[test]
    fn raise_exception_fails_render_with_message() {
        let t = tpl("{% for m in messages %}{% if m.role == 'system' %}\
             {{ raise_exception('System role not supported') }}{% endif %}{% endfor %}");
        let err = t.render(&msgs(), false).unwrap_err().to_string();
        assert!(err.contains("System role not supported"), "{err}");
        assert!(err.contains("test"), "error names the origin: {err}");
        assert!(t.render(&msgs()[1..], false).is_ok());
    }

    #[test]
    fn pycompat_methods_loop_controls_and_tools_none() {
        let t = tpl(
            "{% for m in messages %}{% if m.content.startswith('He') %}{% break %}{% endif %}\
             {{ m.content.split('.')[0] | trim }};{% endfor %}\
             {{ 'x'.upper() }}{{ tools is none }}{{ messages[-1].content.rstrip('!') }}",
        );
        // Booleans print Python-style, as Jinja2 does.
        assert_eq!(t.render(&msgs(), false).unwrap(), "Be brief;Hi;XTrueHello");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = tpl("{{ messages[0] | tojson }}|{{ {'a': [1, 2.5, none], 'é': '<&>'} | tojson }}");
        assert_eq!(
            t.render(&[Message::new("user", "a \"q\"\n")], false)
                .unwrap(),
            r#"{"role": "user", "content": "a \"q\"\n"}|{"a": [1, 2.5, null], "é": "<&>"}"#
        );
        let t = tpl("{{ messages[0] | tojson(indent=2) }}");
        assert_eq!(
            t.render(&[Message::new("user", "x")], false).unwrap(),
            "{\n  \"role\": \"user\",\n  \"content\": \"x\"\n}"
        );
    }

    #[test]
    fn strftime_now_is_callable() {
        let out = tpl("{{ strftime_now('%Y') }}").render(&[], false).unwrap();
        assert_eq!(out.len(), 4, "{out}");
        assert!(out.starts_with('2'), "{out}");
    }

    #[test]
    fn syntax_error_names_origin() {
        let err = ChatTemplate::new("{% if %}", "/m/chat_template.jinja", None, None).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("/m/chat_template.jinja"), "{text}");
        assert!(text.contains("does not compile"), "{text}");
    }
}
