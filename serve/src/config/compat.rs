//! What becomes of the SGLang flags dflash-serve has no argument for (`cli::sglang`), and
//! SGLang's `--log-level` names mapped onto tracing's levels.

use crate::cli::sglang::{disposition, Disposition};
use crate::cli::PassedFlag;

use super::ConfigError;

/// Refuses the first flag whose behaviour dflash-serve lacks; returns the accepted ones as
/// written (`--attention-backend fa3`), for the one start-up warning.
pub fn check_sglang_flags(flags: &[PassedFlag]) -> Result<Vec<String>, ConfigError> {
    let mut accepted = Vec::with_capacity(flags.len());
    for flag in flags {
        let name = crate::cli::sglang::flags()
            .iter()
            .find(|f| f.name == flag.name)
            .map(|f| f.name)
            .unwrap_or("an SGLang flag");
        match disposition(&flag.name) {
            Disposition::Warn => {}
            Disposition::Refuse(reason) => {
                return Err(ConfigError::Unsupported {
                    flag: name,
                    reason: format!("{reason}; remove the flag"),
                })
            }
            Disposition::OnlyValues(allowed, reason) => {
                let fine = !flag.values.is_empty()
                    && flag
                        .values
                        .iter()
                        .all(|v| allowed.iter().any(|a| a.eq_ignore_ascii_case(v)));
                if !fine {
                    return Err(ConfigError::Unsupported {
                        flag: name,
                        reason: format!(
                            "{reason} (given `{}`); remove the flag",
                            flag.values.join(" ")
                        ),
                    });
                }
            }
        }
        accepted.push(flag.display());
    }
    Ok(accepted)
}

/// The one start-up warning naming every accepted SGLang flag that has no effect here.
pub fn warn_no_effect(accepted: &[String]) {
    if !accepted.is_empty() {
        tracing::warn!(
            "SGLang flags with no effect in dflash-serve, accepted so launch lines work: {}",
            accepted.join(", ")
        );
    }
}

/// `--log-level` in SGLang's (Python logging's) names, as a tracing filter directive:
/// critical and error are `error`, warning is `warn`, notset is everything (`trace`).
pub fn log_filter(level: &str) -> Result<&'static str, ConfigError> {
    match level.to_ascii_lowercase().as_str() {
        "critical" | "fatal" | "error" => Ok("error"),
        "warning" | "warn" => Ok("warn"),
        "info" => Ok("info"),
        "debug" => Ok("debug"),
        "trace" | "notset" => Ok("trace"),
        _ => Err(ConfigError::BadValue {
            flag: "--log-level",
            value: level.to_string(),
            reason: "expected critical, error, warning, info or debug".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passed(name: &str, values: &[&str]) -> PassedFlag {
        PassedFlag {
            name: name.into(),
            values: values.iter().map(|v| v.to_string()).collect(),
            negated: false,
        }
    }

    #[test]
    fn python_level_names_map_to_tracing_levels() {
        assert_eq!(log_filter("warning"), Ok("warn"));
        assert_eq!(log_filter("WARNING"), Ok("warn"));
        assert_eq!(log_filter("critical"), Ok("error"));
        assert_eq!(log_filter("debug"), Ok("debug"));
        assert!(log_filter("loud").is_err());
    }

    #[test]
    fn value_checked_flags_pass_their_defaults_and_refuse_the_rest() {
        let ok = check_sglang_flags(&[
            passed("--nnodes", &["1"]),
            passed("--watchdog-timeout", &["60"]),
        ]);
        assert_eq!(
            ok,
            Ok(vec![
                "--nnodes 1".to_string(),
                "--watchdog-timeout 60".into()
            ])
        );
        let err = check_sglang_flags(&[passed("--nnodes", &["2"])]).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "--nnodes is not supported by dflash-serve: dflash-serve runs on one node, so only 1 is allowed (given `2`); remove the flag"
        );
        let err = check_sglang_flags(&[passed("--enable-lora", &[])]).expect_err("refused");
        assert!(
            err.to_string()
                .starts_with("--enable-lora is not supported"),
            "{err}"
        );
    }
}
