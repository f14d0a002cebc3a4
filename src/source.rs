//! Where messages come from: a provider and its key for one conversation, e.g. the provider
//! `webhook` with the key `alerts`. Stored as `provider:key`; the provider part names the
//! registered provider that owns it, the key is that provider's business.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Source(String);

impl Source {
    pub fn new(provider: &str, key: &str) -> Source {
        Source(format!("{provider}:{key}"))
    }

    /// A stored `provider:key`; `None` without a provider part.
    pub fn parse(s: &str) -> Option<Source> {
        let (provider, _) = s.split_once(':')?;
        (!provider.is_empty()).then(|| Source(s.to_string()))
    }

    pub fn provider(&self) -> &str {
        self.0.split_once(':').map_or("", |(p, _)| p)
    }

    pub fn key(&self) -> &str {
        self.0.split_once(':').map_or("", |(_, k)| k)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_splits_at_its_first_colon() {
        let s = Source::new("chat", "1:-5");
        assert_eq!((s.provider(), s.key(), s.as_str()), ("chat", "1:-5", "chat:1:-5"));
        assert_eq!(Source::parse("chat:1:-5"), Some(s));
        assert_eq!(Source::parse("nocolon"), None);
        assert_eq!(Source::parse(":x"), None);
    }
}
