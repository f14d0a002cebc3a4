//! Access tokens an IM system issues per account (an app's `tenant_access_token`, DingTalk's
//! `accessToken`): fetched once, shared by every call until shortly before they expire
//! (`token_kept_for`), fetched again when the IM system refuses one. At most `MAX` are kept.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use super::token_kept_for;
use crate::quiet::Subjects;
use crate::upstream::ApiError;

/// Accounts whose tokens are kept; past it, the expired ones go, and then all.
const MAX: usize = 64;

/// The tokens of one provider's accounts.
pub struct Tokens {
    /// Names the accounts in log lines: `dingtalk: app`.
    what: &'static str,
    kept: Mutex<HashMap<String, (String, Instant)>>,
}

impl Tokens {
    pub fn new(what: &'static str) -> Tokens {
        Tokens {
            what,
            kept: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The token of `account`: the kept one while it has time left, else a new one from
    /// `fetch` (the token, and its lifetime in seconds as the server says), fetched without
    /// holding the others.
    pub fn get(
        &self,
        account: &str,
        fetch: impl FnOnce() -> Result<(String, u64), ApiError>,
    ) -> Result<String, ApiError> {
        let now = Instant::now();
        if let Some((token, _)) = self.lock().get(account).filter(|(_, renew_at)| *renew_at > now) {
            return Ok(token.clone());
        }
        let (token, expire) = fetch()?;
        let mut kept = self.lock();
        if kept.len() >= MAX {
            kept.retain(|_, (_, renew_at)| *renew_at > now);
            if kept.len() >= MAX {
                kept.clear();
            }
        }
        kept.insert(account.to_string(), (token.clone(), now + token_kept_for(expire)));
        Ok(token)
    }

    /// Forgets the token of `account` (refused, or its credentials changed).
    pub fn forget(&self, account: &str) {
        self.lock().remove(account);
    }

    /// Runs `attempt` with the token of `account`; when the IM system refused that token
    /// (`refused`), once more with a new one. A server may refuse every token it issues: said a
    /// line a minute per account, not one a call.
    pub fn authorized<T>(
        &self,
        account: &str,
        fetch: impl Fn() -> Result<(String, u64), ApiError>,
        refused: impl Fn(&ApiError) -> bool,
        mut attempt: impl FnMut(&str) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        static REFUSED: Subjects = Subjects::new();
        let token = self.get(account, &fetch)?;
        match attempt(&token) {
            Err(e) if refused(&e) => {
                if let Some(more) = REFUSED.admit(&format!("{} {account}", self.what)) {
                    log::info!(
                        "{} {account}: its access token was refused ({e}); fetching a new one{more}",
                        self.what
                    );
                }
                self.forget(account);
                let token = self.get(account, &fetch)?;
                attempt(&token)
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::Platform;

    static TEST: Platform = Platform::new("test", |_, _| None);

    #[test]
    fn a_token_is_fetched_once_and_again_only_when_refused() {
        let tokens = Tokens::new("test: app");
        let fetched = std::cell::Cell::new(0);
        let fetch = || {
            fetched.set(fetched.get() + 1);
            Ok((format!("t{}", fetched.get()), 7200))
        };
        let refused = |e: &ApiError| e.status == 401;
        assert_eq!(tokens.get("a", fetch).unwrap(), "t1");
        assert_eq!(tokens.get("a", fetch).unwrap(), "t1", "kept");
        let mut seen = Vec::new();
        let answer = tokens.authorized("a", fetch, refused, |t| {
            seen.push(t.to_string());
            match t {
                "t1" => Err(TEST.refused(401, "expired")),
                _ => Ok("sent"),
            }
        });
        assert_eq!(
            (answer.unwrap(), seen),
            ("sent", vec!["t1".to_string(), "t2".to_string()])
        );
        let twice = tokens.authorized("a", fetch, refused, |_| Err::<(), _>(TEST.refused(401, "no")));
        assert_eq!(twice.unwrap_err().status, 401, "refused again: the caller hears it");
        assert_eq!(fetched.get(), 3, "one new token a refusal, no loop");
        tokens.forget("a");
        assert_eq!(tokens.get("a", fetch).unwrap(), "t4");
    }

    #[test]
    fn at_most_max_accounts_keep_a_token() {
        let tokens = Tokens::new("test: app");
        for i in 0..MAX + 10 {
            let got = tokens.get(&format!("app{i}"), || Ok((format!("t{i}"), 7200)));
            assert_eq!(got.unwrap(), format!("t{i}"));
            assert!(tokens.lock().len() <= MAX, "{} kept", tokens.lock().len());
        }
        let refetched = std::cell::Cell::new(false);
        let newest = tokens.get(&format!("app{}", MAX + 9), || {
            refetched.set(true);
            Ok(("new".into(), 7200))
        });
        assert_eq!(newest.unwrap(), format!("t{}", MAX + 9), "the newest is kept");
        assert!(!refetched.get(), "not fetched again");
    }
}
