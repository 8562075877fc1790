//! Who may open which export: the NBD server's access decisions, pure (no I/O).
//!
//! A connection starts with an [`Admission`] its listener decides: a Unix
//! socket export admits the peer's uid (`SO_PEERCRED`) if the configuration
//! lists it, a TCP export with TLS admits nobody until `STARTTLS` and a client
//! certificate from the cluster CA ([`super::client_cert`]), and a TCP export
//! configured without TLS (`tcp_without_tls`) admits everyone to everything —
//! what every NBD server did before and what the configuration must now ask
//! for by name. Once admitted, a [`Grant`] says which volumes the client sees
//! (`LIST`) and may open (`INFO`, `GO`, `EXPORT_NAME`), and whether only to
//! read (the export is advertised read-only and writes fail with `EPERM`).

use flame_common::auth::VolumePatterns;

/// What an admitted client may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Who it is, for logs and refusals: `client.vm1` (certificate), `uid 1000`.
    pub who: String,
    /// The volumes it may open and list.
    pub volumes: VolumePatterns,
    /// Whether it may only read.
    pub read_only: bool,
}

impl Grant {
    /// Every volume, read and write (a TCP export without TLS).
    pub fn everything(who: impl Into<String>) -> Grant {
        Grant {
            who: who.into(),
            volumes: VolumePatterns::all(),
            read_only: false,
        }
    }

    /// Whether it may open the export `name`.
    pub fn allows(&self, name: &str) -> bool {
        self.volumes.allows(name)
    }
}

/// Where a connection stands with respect to access.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Known and granted.
    Granted(Grant),
    /// A TCP connection to an export that requires TLS, before `STARTTLS`:
    /// every option but `STARTTLS` and `ABORT` is answered
    /// `NBD_REP_ERR_TLS_REQD`, as the NBD spec names it.
    TlsRequired,
    /// A peer that will never be admitted (a Unix-socket peer whose uid is not
    /// listed): every option is answered `NBD_REP_ERR_POLICY` with this reason.
    Refused(String),
}

/// What negotiation does with an option, given the admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OptionVerdict {
    /// Go on with the option.
    Proceed,
    /// Answer with this NBD error reply and message (the connection stays in
    /// negotiation).
    Refuse {
        /// `REP_ERR_*`.
        reply: u32,
        /// Text for the client.
        message: String,
    },
}

/// Whether `option` may proceed under `admission`. `STARTTLS` and `ABORT`
/// always may (they are how an unadmitted client gets in or leaves); `LIST`
/// needs a grant (the handshake then filters the names with it); an open
/// (`INFO`, `GO`, `EXPORT_NAME`) of `name` needs a grant that allows it.
/// Anything else (`STRUCTURED_REPLY`, unknown options) needs a grant too:
/// before TLS nothing but `STARTTLS` is negotiated in clear.
pub fn check_option(admission: &Admission, option: u32, name: Option<&str>) -> OptionVerdict {
    use super::proto::*;
    if option == OPT_STARTTLS || option == OPT_ABORT {
        return OptionVerdict::Proceed;
    }
    match admission {
        Admission::TlsRequired => OptionVerdict::Refuse {
            reply: REP_ERR_TLS_REQD,
            message: "this export requires TLS: send STARTTLS and a client certificate \
                      issued by the cluster CA (flame-admin tls client)"
                .into(),
        },
        Admission::Refused(reason) => OptionVerdict::Refuse {
            reply: REP_ERR_POLICY,
            message: reason.clone(),
        },
        Admission::Granted(grant) => match name {
            Some(n) if !grant.allows(n) => OptionVerdict::Refuse {
                reply: REP_ERR_POLICY,
                message: format!(
                    "{} may not open export {n:?} (its volumes: {})",
                    grant.who, grant.volumes
                ),
            },
            _ => OptionVerdict::Proceed,
        },
    }
}

/// One entry of a Unix-socket export's allowlist: a uid and what it may do.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UidGrant {
    /// The peer's uid (`SO_PEERCRED`).
    pub uid: u32,
    /// Volumes it may open: names or `prefix*`, `["*"]` for every volume
    /// (required: a forgotten key must not grant everything).
    pub volumes: VolumePatterns,
    /// Only reads (default: false).
    #[serde(default)]
    pub read_only: bool,
}

/// The admission of a Unix-socket peer with `uid`: what `allow` grants it,
/// or, with an empty `allow`, everything to the server's own user
/// (`own_uid`) and nothing to anyone else.
pub fn unix_admission(allow: &[UidGrant], uid: u32, own_uid: u32) -> Admission {
    let who = format!("uid {uid}");
    if allow.is_empty() {
        if uid == own_uid {
            return Admission::Granted(Grant::everything(who));
        }
    } else if let Some(g) = allow.iter().find(|g| g.uid == uid) {
        return Admission::Granted(Grant {
            who,
            volumes: g.volumes.clone(),
            read_only: g.read_only,
        });
    }
    Admission::Refused(format!(
        "uid {uid} is not allowed on this socket (flame-nbd's unix.allow)"
    ))
}

#[cfg(test)]
mod tests {
    use super::super::proto::*;
    use super::*;

    fn grant(volumes: &str, read_only: bool) -> Admission {
        Admission::Granted(Grant {
            who: "client.vm1".into(),
            volumes: VolumePatterns::parse_list(volumes).unwrap(),
            read_only,
        })
    }

    #[test]
    fn before_tls_only_starttls_and_abort_proceed() {
        for opt in [OPT_STARTTLS, OPT_ABORT] {
            assert_eq!(
                check_option(&Admission::TlsRequired, opt, None),
                OptionVerdict::Proceed
            );
        }
        for opt in [OPT_LIST, OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY, 99] {
            match check_option(&Admission::TlsRequired, opt, Some("demo")) {
                OptionVerdict::Refuse { reply, .. } => assert_eq!(reply, REP_ERR_TLS_REQD),
                v => panic!("option {opt} before TLS: {v:?}"),
            }
        }
    }

    #[test]
    fn a_refused_peer_gets_policy_errors_with_the_reason() {
        let a = Admission::Refused("uid 7 is not allowed".into());
        match check_option(&a, OPT_GO, Some("demo")) {
            OptionVerdict::Refuse { reply, message } => {
                assert_eq!(reply, REP_ERR_POLICY);
                assert!(message.contains("uid 7"), "{message}");
            }
            v => panic!("{v:?}"),
        }
        assert_eq!(check_option(&a, OPT_ABORT, None), OptionVerdict::Proceed);
    }

    #[test]
    fn a_grant_opens_only_its_volumes() {
        let a = grant("vm1-*,shared", true);
        assert_eq!(
            check_option(&a, OPT_GO, Some("vm1-root")),
            OptionVerdict::Proceed
        );
        assert_eq!(check_option(&a, OPT_LIST, None), OptionVerdict::Proceed);
        match check_option(&a, OPT_INFO, Some("vm2-root")) {
            OptionVerdict::Refuse { reply, message } => {
                assert_eq!(reply, REP_ERR_POLICY);
                assert!(message.contains("client.vm1"), "{message}");
            }
            v => panic!("{v:?}"),
        }
        assert_eq!(
            check_option(&grant("", false), OPT_EXPORT_NAME, Some("any")),
            OptionVerdict::Proceed
        );
    }

    #[test]
    fn unix_peers_are_admitted_by_uid() {
        // No list: the server's own user only.
        assert!(matches!(
            unix_admission(&[], 1000, 1000),
            Admission::Granted(Grant {
                read_only: false,
                ..
            })
        ));
        assert!(matches!(
            unix_admission(&[], 0, 1000),
            Admission::Refused(_)
        ));
        let allow = vec![UidGrant {
            uid: 33,
            volumes: VolumePatterns::parse_list("web").unwrap(),
            read_only: true,
        }];
        match unix_admission(&allow, 33, 1000) {
            Admission::Granted(g) => {
                assert!(g.read_only && g.allows("web") && !g.allows("db"));
                assert_eq!(g.who, "uid 33");
            }
            a => panic!("{a:?}"),
        }
        // A list replaces the default: the server's own user is not in it.
        assert!(matches!(
            unix_admission(&allow, 1000, 1000),
            Admission::Refused(_)
        ));
    }
}
